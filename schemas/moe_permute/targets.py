"""Device restrictions of MoeTokenPermute and MoeTokenPermuteGrad, as rows (sources in ``schema``'s docstring)."""

from __future__ import annotations

from ...ir._dtypes import DType
from ...ir._schema import InferContext
from ..targets import A2, A3, A5, Finding, TargetRule, kernel_rule, register_target_rules
from .schema import FORWARD, GRAD, ID_LIMIT

_TILED = frozenset({A2, A3})
"""Where the forward's tiling (moe_token_permute_tiling.cpp) and the grad's docs set the limits below."""
_REROUTED = "CANN re-routes only the aclnn API to MoeInitRoutingV2Grad on ascend950 (aclnn_moe_token_permute_grad.cpp)"


def _topk(ctx: InferContext) -> Finding | None:
    indices = ctx.input("indices")
    topk = indices.shape[1] if indices.rank == 2 else 1
    if not isinstance(topk, int) or topk <= 512:
        return None
    return Finding(ctx.input_subject("indices", 1), "topK <= 512", topk)


def _slot_count(ctx: InferContext) -> Finding | None:
    indices = ctx.input("indices")
    if not indices.is_static:
        return None
    slots = indices.shape[0] * (indices.shape[1] if indices.rank == 2 else 1)
    if slots < ID_LIMIT:
        return None
    return Finding(ctx.input_subject("indices"), f"fewer than {ID_LIMIT} elements (tokens * topK)", slots)


def _int8_tokens(ctx: InferContext) -> Finding | None:
    if ctx.input("tokens").dtype != DType.INT8:
        return None
    return Finding(ctx.input_subject("tokens"), "bfloat16, float16 or float32 (int8 tokens: Ascend 950 only)", "int8")


def _grad_topk(ctx: InferContext) -> Finding | None:
    topk = ctx.attr("num_topk")
    return None if topk <= 512 else Finding(ctx.attr_subject("num_topk"), "num_topk <= 512", topk)


register_target_rules(
    kernel_rule("MP-T1", FORWARD, frozenset({A2, A3, A5})),
    kernel_rule("MPG-T1", GRAD, _TILED, _REROUTED),
    TargetRule("MP-T2", FORWARD, _TILED, _topk, src="code (tiling)"),
    TargetRule("MP-T3", FORWARD, _TILED, _slot_count, src="code (tiling)"),
    TargetRule("MP-T4", FORWARD, _TILED, _int8_tokens, src="doc"),
    TargetRule("MPG-T2", GRAD, _TILED, _grad_topk, src="doc"),
)
