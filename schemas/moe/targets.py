"""Device restrictions of the moe ops (the contract's target table), registered as rows."""

from __future__ import annotations

from ...ir._dtypes import DType
from ...ir._schema import InferContext
from ..targets import A2, A3, K9030, KX90, P310, Finding, TargetRule, kernel_rule, register_target_rules
from .schema import FORWARD, GRAD

# -- MoE token unpermute (spec 3.2; MoeTokenUnpermute's op def also registers ascend310p, kirinx90, kirin9030) --
_SMALL = frozenset({P310, KX90, K9030})
_REROUTED = "CANN re-routes only the aclnn API to MoeFinalizeRoutingV2(Grad) on ascend950"


def _half_or_float(ctx: InferContext) -> Finding | None:
    for i, t in enumerate(ctx.inputs):
        if t is not None and t.dtype == DType.BFLOAT16:
            return Finding(ctx.input_subject(i), "float16 or float32 (no bfloat16 kernel on this device)", "bfloat16")
    return None


def _hidden_size(ctx: InferContext) -> Finding | None:
    h = ctx.input("permuted_tokens").shape[1]
    if not isinstance(h, int) or (h % 128 == 0 and h <= 10240):
        return None
    return Finding(ctx.input_subject("permuted_tokens", 1), "a hidden size that is a multiple of 128 and <= 10240", h)


def _topk_limit(ctx: InferContext) -> Finding | None:
    probs = ctx.input("probs")
    if probs is None or not isinstance(probs.shape[1], int) or probs.shape[1] <= 512:
        return None
    return Finding(ctx.input_subject("probs", 1), "topK <= 512", probs.shape[1])


register_target_rules(
    kernel_rule("MU-T1", FORWARD, frozenset({A2, A3}) | _SMALL, _REROUTED),
    kernel_rule("MG-T1", GRAD, frozenset({A2, A3}), _REROUTED),
    TargetRule("MU-T2", FORWARD, frozenset({A2, A3}) | _SMALL, _topk_limit),
    TargetRule("MG-T2", GRAD, frozenset({A2, A3}), _topk_limit),
    TargetRule("MU-T3", FORWARD, _SMALL, _half_or_float, src="code (op def)"),
    TargetRule("MU-T4", FORWARD, _SMALL, _hidden_size, src="code (op def)"),
)
