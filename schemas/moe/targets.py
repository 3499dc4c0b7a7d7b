"""Device restrictions of the moe ops (the contract's target table), registered as rows."""

from __future__ import annotations

from .._schema import InferContext
from ..targets import A2, A3, A5, Finding, TargetRule, register_target_rules
from .schema import FORWARD, GRAD


# -- MoE token unpermute (spec 3.2) --------------------------------------------------------


def _no_moe_graph_kernel(ctx: InferContext) -> Finding:
    return Finding("op", f"a target with a {ctx.schema.op_type} graph kernel ({A2}, {A3})", ctx.target,
                   "CANN re-routes only the aclnn API to MoeFinalizeRoutingV2(Grad) on ascend950")


def _topk_limit(ctx: InferContext) -> Finding | None:
    probs = ctx.input("probs")
    if probs is None or not isinstance(probs.shape[1], int) or probs.shape[1] <= 512:
        return None
    return Finding(ctx.input_subject("probs", 1), "topK <= 512", probs.shape[1])


register_target_rules(
    TargetRule("MU-T1", FORWARD, frozenset({A5}), _no_moe_graph_kernel),
    TargetRule("MG-T1", GRAD, frozenset({A5}), _no_moe_graph_kernel),
    TargetRule("MU-T2", FORWARD, frozenset({A2, A3}), _topk_limit),
    TargetRule("MG-T2", GRAD, frozenset({A2, A3}), _topk_limit),
)
