"""Per-device restrictions (the contract's ``..-T#`` target rules), as data.

Each row is one rule of the spec's target tables: its ID, op, the targets it binds on, the
source CANN states it in, and a predicate that returns a Finding when a node breaks it (or
None: satisfied, not applicable -- the table's "when" column -- or undecidable on symbols).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..ir._errors import GraphError

from ._schema import InferContext
from .rotary import EMPTY_GRAD_SLICE_HINT, rotary_slice
from .sparse_attention import INT64_MAX, role_sizes

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
    warning: bool = False
    """A ``..-W#`` row: reported as a warning, never a violation."""


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


def _empty_grad_slice(ctx: InferContext) -> Finding | None:
    if not _slice_is_empty(ctx):
        return None
    return Finding(ctx.attr_subject("partial_slice"), "a non-empty slice [start, end)", list(ctx.attr("partial_slice")),
                   EMPTY_GRAD_SLICE_HINT)


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


# -- sparse flash attention (spec 4.4) ---------------------------------------------------------
SFA, SFA_GRAD = "SparseFlashAttention", "SparseFlashAttentionGrad"
_N1_POW2 = frozenset({1, 2, 4, 8, 16, 32, 64, 128})
_N1_GRAD_950 = frozenset({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128})


def _dim_subject(ctx: InferContext, role: str) -> str:
    return f"{role} ({ctx.input_subject('query')} and related shapes)"


def _in_set(role: str, allowed: frozenset[int] | range, text: str) -> Callable[[InferContext], Finding | None]:
    def check(ctx: InferContext) -> Finding | None:
        size = role_sizes(ctx).get(role)
        if not isinstance(size, int) or size in allowed:
            return None
        return Finding(_dim_subject(ctx, role), f"{role} in {text}", size)
    return check


def _attention_mode(ctx: InferContext) -> Finding | None:
    mode = ctx.attr("attention_mode")
    return None if mode == 2 else Finding(ctx.attr_subject("attention_mode"), "2", mode,
                                          "the IR default 0 is rejected on every device")


def _rope_dim(required: bool) -> Callable[[InferContext], Finding | None]:
    def check(ctx: InferContext) -> Finding | None:
        rope = ctx.input("query_rope")
        if rope is None:
            return Finding(ctx.input_subject("query_rope"), "a rope tensor (Dr = 64)", "None") if required else None
        dr = rope.shape[-1]
        return None if not isinstance(dr, int) or dr == 64 else Finding(ctx.input_subject("query_rope", rope.rank - 1),
                                                                        "Dr == 64", dr)
    return check


def _head_dims(ctx: InferContext) -> Finding | None:
    sizes = role_sizes(ctx)
    for role in ("D", "D2"):
        if isinstance(sizes[role], int) and sizes[role] != 512:
            return Finding(_dim_subject(ctx, role), f"{role} == 512", sizes[role])
    return None


def _block_size(allowed: frozenset[int], text: str) -> Callable[[InferContext], Finding | None]:
    def check(ctx: InferContext) -> Finding | None:
        bs = ctx.attr("sparse_block_size")
        return None if bs in allowed else Finding(ctx.attr_subject("sparse_block_size"), text, bs)
    return check


def _unbounded_tokens(ctx: InferContext) -> Finding | None:
    for attr in ("pre_tokens", "next_tokens"):
        if ctx.attr(attr) != INT64_MAX:
            return Finding(ctx.attr_subject(attr), f"{INT64_MAX} (INT64_MAX)", ctx.attr(attr))
    return None


def _no_sinks(ctx: InferContext) -> Finding | None:
    return None if ctx.input("sinks") is None else Finding(ctx.input_subject("sinks"), "None", "a tensor",
                                                           "sinks are unsupported on this device (docs)")


def _value_present(ctx: InferContext) -> Finding | None:
    return None if ctx.input("value") is not None else Finding(ctx.input_subject("value"), "a tensor", "None",
                                                               "no KV merge on this device")


def _grad_extents(ctx: InferContext) -> Finding | None:
    sizes = role_sizes(ctx)
    limits = [("B", 256)] + ([("S1", 131072), ("S2", 131072)] if "S1" in sizes else [])
    for role, limit in limits:
        if isinstance(sizes[role], int) and sizes[role] > limit:
            return Finding(_dim_subject(ctx, role), f"{role} <= {limit}", sizes[role])
    return None


def _selection_memory(ctx: InferContext) -> Finding | None:
    k, bs = role_sizes(ctx)["K"], ctx.attr("sparse_block_size")
    if isinstance(k, int) and k * bs > 100000:
        return Finding(ctx.input_subject("sparse_indices", ctx.input("sparse_indices").rank - 1),
                       "K * sparse_block_size <= 100000", f"{k} * {bs} = {k * bs}", "large device memory use")
    return None


_RULES: tuple[TargetRule, ...] = (
    TargetRule("RP-T1", ROPE_GRAD, frozenset({A2, A3}), _no_grad_kernel),
    TargetRule("RP-W1", ROPE_GRAD, frozenset(TARGETS), _empty_grad_slice, src="doc", warning=True),
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
    TargetRule("SF-T1", SFA, frozenset(TARGETS), _attention_mode),
    TargetRule("SF-T2", SFA, frozenset(TARGETS), _rope_dim(required=True)),
    TargetRule("SA-T3", SFA, frozenset(TARGETS), _in_set("N2", frozenset({1}), "{1}")),
    TargetRule("SA-T3", SFA_GRAD, frozenset(TARGETS), _in_set("N2", frozenset({1}), "{1}")),
    TargetRule("SA-T4", SFA, frozenset({A2, A3}), _in_set("N1", _N1_POW2, "{1, 2, 4, ..., 128}")),
    TargetRule("SA-T4", SFA, frozenset({A5}), _in_set("N1", range(1, 129), "1..128")),
    TargetRule("SA-T4", SFA_GRAD, frozenset({A2, A3}), _in_set("N1", _N1_POW2, "{1, 2, 4, ..., 128}")),
    TargetRule("SA-T4", SFA_GRAD, frozenset({A5}), _in_set("N1", _N1_GRAD_950, "{" + ", ".join(
        map(str, sorted(_N1_GRAD_950))) + "}")),
    TargetRule("SA-T5", SFA, frozenset(TARGETS), _head_dims),
    TargetRule("SA-T5", SFA_GRAD, frozenset(TARGETS), _head_dims, src="doc"),
    TargetRule("SG-T6", SFA_GRAD, frozenset(TARGETS), _rope_dim(required=False), src="doc"),
    TargetRule("SA-T7", SFA, frozenset({A2, A3}), _block_size(frozenset(1 << i for i in range(8)),
                                                              "a power of 2 in [1, 128]")),
    TargetRule("SA-T7", SFA, frozenset({A5}), _block_size(frozenset({1}), "1")),
    TargetRule("SA-T7", SFA_GRAD, frozenset({A2, A3}), _block_size(frozenset({1, 8, 16, 32, 64}),
                                                                   "one of {1, 8, 16, 32, 64}"), src="doc"),
    TargetRule("SA-T7", SFA_GRAD, frozenset({A5}), _block_size(frozenset({1}), "1")),
    TargetRule("SG-T8", SFA_GRAD, frozenset(TARGETS), _in_set("K", frozenset(range(1024, 8193, 1024)),
                                                              "{1024, 2048, ..., 8192}"), src="doc"),
    TargetRule("SF-T9", SFA, frozenset(TARGETS), _unbounded_tokens),
    TargetRule("SF-T10", SFA, frozenset({A2, A3}), _no_sinks, src="doc"),
    TargetRule("SG-T11", SFA_GRAD, frozenset({A5}), _value_present),
    TargetRule("SG-T12", SFA_GRAD, frozenset(TARGETS), _grad_extents, src="doc"),
    TargetRule("SG-W2", SFA_GRAD, frozenset(TARGETS), _selection_memory, src="doc", warning=True),
)
