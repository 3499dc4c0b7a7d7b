"""Device restrictions of the rotary ops (the contract's target table), registered as rows.

Issue 27, item 3: RP-S6 no longer binds the grad anywhere. An empty dy/cos/sin (or slice) makes the grad the
identity (``schema.grad_is_noop``), as the only grad kernel (ascend950's arch35 tiling, 2026-08) does; on
ascend910b/ascend910_93 RP-T1 already refuses every grad, so no row there would state anything CANN states.
On ascend950 RP-T2 (mode 1) still binds an identity grad (the tiling checks the mode first); RP-T3 does not.
"""

from __future__ import annotations

from collections.abc import Callable

from ...ir._schema import InferContext
from ..targets import A2, A3, A5, ASCEND_TRAINING, Finding, TargetRule, kernel_rule, register_target_rules
from .schema import FORWARD, GRAD, EMPTY_GRAD_SLICE_HINT, grad_is_noop, rotary_slice


# -- rotary (spec 2.3) -------------------------------------------------------------------


def _slice_is_empty(ctx: InferContext) -> bool:
    return rotary_slice(ctx)[2] == 0


def _empty_grad_slice(ctx: InferContext) -> Finding | None:
    if not _slice_is_empty(ctx):
        return None
    return Finding(ctx.attr_subject("partial_slice"), "a non-empty slice [start, end)", list(ctx.attr("partial_slice")),
                   EMPTY_GRAD_SLICE_HINT)


def _grad_noop(ctx: InferContext) -> bool:
    return grad_is_noop(rotary_slice(ctx)[2], *(t.shape for t in ctx.inputs))


def _mode_is_interleave(ctx: InferContext) -> Finding | None:
    mode = ctx.attr("rotary_mode")
    if mode == 1:
        return None
    return Finding(ctx.attr_subject("rotary_mode"), "1 (interleave: the only mode with a kernel)", mode,
                   "the IR default 0 is rejected on every device")


def _head_dim_limit(forward: bool) -> Callable[[InferContext], Finding | None]:
    def check(ctx: InferContext) -> Finding | None:
        d = ctx.input(0).shape[3]
        if (_slice_is_empty(ctx) if forward else _grad_noop(ctx)) or not isinstance(d, int) or d <= 1024:
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


register_target_rules(
    kernel_rule("RP-T1", FORWARD, ASCEND_TRAINING),
    kernel_rule("RP-T1", GRAD, frozenset({A5}), "CANN ships this kernel for ascend950 only"),
    TargetRule("RP-W1", GRAD, ASCEND_TRAINING, _empty_grad_slice, src="doc (950 tiling passes it)", warning=True),
    TargetRule("RP-T2", FORWARD, frozenset({A2, A3, A5}), _mode_is_interleave),
    TargetRule("RP-T2", GRAD, frozenset({A5}), _mode_is_interleave),
    TargetRule("RP-T3", FORWARD, frozenset({A2, A3, A5}), _head_dim_limit(forward=True)),
    TargetRule("RP-T3", GRAD, frozenset({A5}), _head_dim_limit(forward=False)),   # not when the grad is the identity
    TargetRule("RP-T4", FORWARD, frozenset({A2, A3, A5}), _head_dim_even),
    TargetRule("RP-T5", FORWARD, frozenset({A2, A3}), _cos_layout),
)
