"""Device restrictions of the moe ops (the contract's target table), registered as rows."""

from __future__ import annotations

from collections.abc import Callable

from ...ir._dtypes import DType
from ...ir._schema import InferContext
from ..targets import A2, A3, A5, K9030, KX90, P310, Finding, TargetRule, kernel_rule, register_target_rules
from .schema import BF16_F32_HINT, FORWARD, GRAD, PADDED_MODE_HINT, is_bf16_tokens_f32_probs

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


def _padded_mode(refused: bool) -> Callable[[InferContext], Finding | None]:
    """MU-T5 / MG-T3: padded_mode=True is ignored by the A2/A3 (and small-device) tiling, refused on ascend950.

    Sources (issue 27, item 3): ops-transformer moe/moe_token_unpermute(_grad)/op_host/op_api/
    aclnn_moe_token_unpermute(_grad).cpp @c29bc106 (2025-11-15): on ASCEND910_95 (ascend950)
    ``CHECK_RET(paddedMode == false, ACLNN_ERR_PARAM_INVALID)``; the A2/A3 tilings ignore the attribute.
    """
    def check(ctx: InferContext) -> Finding | None:
        if not ctx.attr("padded_mode"):
            return None
        hint = ("aclnn re-routes the op to MoeFinalizeRoutingV2(Grad) here and returns ACLNN_ERR_PARAM_INVALID "
                "(161002)") if refused else PADDED_MODE_HINT
        return Finding(ctx.attr_subject("padded_mode"), "False", True, hint)
    return check


def _bf16_tokens_f32_probs(ctx: InferContext) -> Finding | None:
    """MG-W2: bfloat16 tokens with float32 probs return NaN on the device (issue 27, item 3: MindSpeed's
    unpermute wrapper casts permuted_tokens to probs' dtype, "make sure permuted_tokens has the same dtype with
    probs", and torchtitan-npu casts around the op). Shown by geir.check and at build (schema.py)."""
    if not is_bf16_tokens_f32_probs(ctx):
        return None
    return Finding(ctx.input_subject("probs"), "bfloat16 probs with bfloat16 tokens", "float32", BF16_F32_HINT)


register_target_rules(
    kernel_rule("MU-T1", FORWARD, frozenset({A2, A3}) | _SMALL, _REROUTED),
    kernel_rule("MG-T1", GRAD, frozenset({A2, A3}), _REROUTED),
    TargetRule("MU-T2", FORWARD, frozenset({A2, A3}) | _SMALL, _topk_limit),
    TargetRule("MG-T2", GRAD, frozenset({A2, A3}), _topk_limit),
    TargetRule("MU-T3", FORWARD, _SMALL, _half_or_float, src="code (op def)"),
    TargetRule("MU-T4", FORWARD, _SMALL, _hidden_size, src="code (op def)"),
    TargetRule("MU-T5", FORWARD, frozenset({A2, A3}) | _SMALL, _padded_mode(False), src="code (tiling ignores it)",
               warning=True),
    TargetRule("MU-T5", FORWARD, frozenset({A5}), _padded_mode(True), src="code (aclnn op_api: 161002)"),
    TargetRule("MG-T3", GRAD, frozenset({A2, A3}), _padded_mode(False), src="code (tiling ignores it)", warning=True),
    TargetRule("MG-T3", GRAD, frozenset({A5}), _padded_mode(True), src="code (aclnn op_api: 161002)"),
    TargetRule("MG-W2", GRAD, frozenset({A2, A3}), _bf16_tokens_f32_probs, src="code (device NaN; frameworks cast)",
               warning=True),
)
