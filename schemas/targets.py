"""Per-device restrictions (the contract's ``..-T#`` target rules), as data.

Each row is one rule of the spec's target tables: its ID, op, the targets it binds on, the
source CANN states it in, and a predicate that returns a Finding when a node breaks it (or
None: satisfied, not applicable -- the table's "when" column -- or undecidable on symbols).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from geir._errors import GraphError

from ._schema import InferContext
from .rotary import rotary_slice

__all__ = ["TARGETS", "Finding", "TargetRule", "rules_for", "validate_target"]

A2, A3, A5 = "ascend910b", "ascend910_93", "ascend950"
TARGETS: tuple[str, ...] = (A2, A3, A5)
"""Atlas A2, Atlas A3, Ascend 950PR/950DT."""


@dataclass(frozen=True)
class Finding:
    subject: str
    expected: object
    got: object
    hint: str | None = None


@dataclass(frozen=True)
class TargetRule:
    rule: str
    op_type: str
    targets: frozenset[str]
    check: Callable[[InferContext], Finding | None]
    src: str = "code"


def validate_target(target: str) -> str:
    if target not in TARGETS:
        raise GraphError(f"unknown target {target!r}: expected one of {', '.join(TARGETS)}")
    return target


def rules_for(op_type: str, target: str) -> list[TargetRule]:
    return [r for r in _RULES if r.op_type == op_type and target in r.targets]


# -- rotary (spec 2.3) -------------------------------------------------------------------
ROPE, ROPE_GRAD = "InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"


def _slice_is_empty(ctx: InferContext) -> bool:
    return rotary_slice(ctx)[2] == 0


def _no_grad_kernel(ctx: InferContext) -> Finding:
    return Finding("op", f"a target with a {ROPE_GRAD} kernel ({A5})", ctx.target,
                   "CANN ships this kernel for ascend950 only")


def _mode_is_interleave(ctx: InferContext) -> Finding | None:
    mode = ctx.attr("rotary_mode")
    if mode == 1:
        return None
    return Finding(ctx.attr_subject("rotary_mode"), "1 (interleave: the only mode with a kernel)", mode,
                   "the IR default 0 is rejected on every device")


def _head_dim_limit(forward: bool) -> Callable[[InferContext], Finding | None]:
    def check(ctx: InferContext) -> Finding | None:
        d = ctx.input(0).shape[3]
        if (forward and _slice_is_empty(ctx)) or not isinstance(d, int) or d <= 1024:
            return None
        return Finding(ctx.input_subject(0, 3), "D <= 1024", d)
    return check


def _head_dim_even(ctx: InferContext) -> Finding | None:
    d = ctx.input(0).shape[3]
    if _slice_is_empty(ctx) or not isinstance(d, int) or d % 2 == 0:
        return None
    return Finding(ctx.input_subject(0, 3), "an even D", d)


def _cos_layout(ctx: InferContext) -> Finding | None:
    if _slice_is_empty(ctx):
        return None
    x, cos = ctx.input(0).shape, ctx.input(1).shape
    hint = "this device takes cos/sin of shape (B, 1, 1, L) or (B, S, 1, L)"
    if ctx.equal(cos[0], x[0]) is False:
        return Finding(ctx.input_subject(1, 0), f"{x[0]} (B, dim 0 of input 0 'x')", cos[0], hint)
    if isinstance(cos[2], int) and cos[2] != 1:
        return Finding(ctx.input_subject(1, 2), 1, cos[2], hint)
    return None


# -- MoE token unpermute (spec 3.2) --------------------------------------------------------
MOE, MOE_GRAD = "MoeTokenUnpermute", "MoeTokenUnpermuteGrad"


def _no_moe_graph_kernel(ctx: InferContext) -> Finding:
    return Finding("op", f"a target with a {ctx.schema.op_type} graph kernel ({A2}, {A3})", ctx.target,
                   "CANN re-routes only the aclnn API to MoeFinalizeRoutingV2(Grad) on ascend950")


def _topk_limit(ctx: InferContext) -> Finding | None:
    probs = ctx.input("probs")
    if probs is None or not isinstance(probs.shape[1], int) or probs.shape[1] <= 512:
        return None
    return Finding(ctx.input_subject("probs", 1), "topK <= 512", probs.shape[1])


_RULES: tuple[TargetRule, ...] = (
    TargetRule("RP-T1", ROPE_GRAD, frozenset({A2, A3}), _no_grad_kernel),
    TargetRule("RP-T2", ROPE, frozenset({A2, A3, A5}), _mode_is_interleave),
    TargetRule("RP-T2", ROPE_GRAD, frozenset({A5}), _mode_is_interleave),
    TargetRule("RP-T3", ROPE, frozenset({A2, A3, A5}), _head_dim_limit(forward=True)),
    TargetRule("RP-T3", ROPE_GRAD, frozenset({A5}), _head_dim_limit(forward=False)),
    TargetRule("RP-T4", ROPE, frozenset({A2, A3, A5}), _head_dim_even),
    TargetRule("RP-T5", ROPE, frozenset({A2, A3}), _cos_layout),
    TargetRule("MU-T1", MOE, frozenset({A5}), _no_moe_graph_kernel),
    TargetRule("MG-T1", MOE_GRAD, frozenset({A5}), _no_moe_graph_kernel),
    TargetRule("MU-T2", MOE, frozenset({A2, A3}), _topk_limit),
    TargetRule("MG-T2", MOE_GRAD, frozenset({A2, A3}), _topk_limit),
)
