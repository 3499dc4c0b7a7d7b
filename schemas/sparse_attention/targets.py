"""Device restrictions of the sparse attention ops (the contract's target table), registered as rows."""

from __future__ import annotations

from collections.abc import Callable

from ...ir._schema import InferContext
from ..targets import A2, A3, A5, ASCEND_TRAINING, Finding, TargetRule, kernel_rule, register_target_rules
from .schema import FORWARD, GRAD, INT64_MAX, is_paged, role_sizes


# -- sparse flash attention (spec 4.4) ---------------------------------------------------------
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
                                                           "sinks need ascend950 (aclnnSparseFlashAttentionV2 "
                                                           "returns 361001 elsewhere)")


def _value_present(ctx: InferContext) -> Finding | None:
    return None if ctx.input("value") is not None else Finding(ctx.input_subject("value"), "a tensor", "None",
                                                               "no KV merge on this device")


def _grad_extents(ctx: InferContext) -> Finding | None:
    """SG-T12: ``B <= 256``; BSND ``S1 <= 128K``, ``S2 <= 1M``.

    Source: ops-transformer attention/sparse_flash_attention_grad/docs/aclnnSparseFlashAttentionGrad.md @05328cd9
    (2026-08; issue 27, item 3): "S1支持1~128K，S2支持1~1M" (S2's former 131,072 is stale).
    """
    sizes = role_sizes(ctx)
    limits = [("B", 256)] + ([("S1", 131072), ("S2", 1048576)] if "S1" in sizes else [])
    for role, limit in limits:
        if isinstance(sizes[role], int) and sizes[role] > limit:
            return Finding(_dim_subject(ctx, role), f"{role} <= {limit}", sizes[role])
    return None


def _value_is_key(ctx: InferContext) -> Finding | None:
    """SG-T13: value is the key tensor itself, or absent (KV merge: the grad then reads key as value).

    Source: ops-transformer attention/sparse_flash_attention_grad/docs/aclnnSparseFlashAttentionGrad.md @05328cd9
    (公共约束): "当前只支持value和key完全一致的场景" (issue 27, item 3). A graph states "the same tensor" as the same
    Value: a different Value is reported even when its data equals key's (geir cannot see data at check time),
    and a graph checked without its values (a bare InferContext) is not judged.
    """
    if ctx.input("value") is None or ctx.same_input("value", "key") is not False:
        return None
    return Finding(ctx.input_subject("value"), "the same tensor as input 1 'key' (or None: KV merge)",
                   "a different tensor", "the docs support only value identical to key; pass key as value")


def _selection_memory(ctx: InferContext) -> Finding | None:
    k, bs = role_sizes(ctx)["K"], ctx.attr("sparse_block_size")
    if isinstance(k, int) and k * bs > 100000:
        return Finding(ctx.input_subject("sparse_indices", ctx.input("sparse_indices").rank - 1),
                       "K * sparse_block_size <= 100000", f"{k} * {bs} = {k * bs}", "large device memory use")
    return None


def _paged_on_950(ctx: InferContext) -> Finding | None:
    """PA-S6: ascend950 reads a paged cache with sparse_block_size 1 (spec 4.11; the 950 tiling's
    CheckSingleParaSparseBlockSize). Sinks with a paged cache are allowed there since 2026-08: the tiling's
    CheckSinks checks only dtype and shape (N1,), and test_sparse_flash_attention_tiling.cpp (arch35) runs
    PA_BSND on Ascend950 (issue 27, item 3); the former "no sinks" half of PA-S6 is gone."""
    if not is_paged(ctx):
        return None
    bs = ctx.attr("sparse_block_size")
    return None if bs == 1 else Finding(ctx.attr_subject("sparse_block_size"), "1 (with a paged cache on ascend950)", bs)


register_target_rules(
    kernel_rule("SA-T0", FORWARD, ASCEND_TRAINING),
    kernel_rule("SA-T0", GRAD, ASCEND_TRAINING),
    TargetRule("SF-T1", FORWARD, ASCEND_TRAINING, _attention_mode),
    TargetRule("SF-T2", FORWARD, ASCEND_TRAINING, _rope_dim(required=True)),
    TargetRule("SA-T3", FORWARD, ASCEND_TRAINING, _in_set("N2", frozenset({1}), "{1}")),
    TargetRule("SA-T3", GRAD, ASCEND_TRAINING, _in_set("N2", frozenset({1}), "{1}")),
    TargetRule("SA-T4", FORWARD, frozenset({A2, A3}), _in_set("N1", _N1_POW2, "{1, 2, 4, ..., 128}")),
    TargetRule("SA-T4", FORWARD, frozenset({A5}), _in_set("N1", range(1, 129), "1..128")),
    TargetRule("SA-T4", GRAD, frozenset({A2, A3}), _in_set("N1", _N1_POW2, "{1, 2, 4, ..., 128}")),
    TargetRule("SA-T4", GRAD, frozenset({A5}), _in_set("N1", _N1_GRAD_950, "{" + ", ".join(
        map(str, sorted(_N1_GRAD_950))) + "}")),
    TargetRule("SA-T5", FORWARD, ASCEND_TRAINING, _head_dims),
    TargetRule("SA-T5", GRAD, frozenset({A2, A3}), _head_dims, src="doc (A2/A3 tiling runs D = 128)"),
    TargetRule("SA-T5", GRAD, frozenset({A5}), _head_dims, src="code (950 tiling)"),
    TargetRule("SG-T6", GRAD, frozenset({A2, A3}), _rope_dim(required=False), src="doc"),
    TargetRule("SG-T6", GRAD, frozenset({A5}), _rope_dim(required=False), src="code (950 tiling)"),
    TargetRule("SA-T7", FORWARD, frozenset({A2, A3}), _block_size(frozenset(1 << i for i in range(8)),
                                                              "a power of 2 in [1, 128]")),
    TargetRule("SA-T7", FORWARD, frozenset({A5}), _block_size(frozenset({1}), "1")),
    TargetRule("SA-T7", GRAD, frozenset({A2, A3}), _block_size(frozenset({1, 8, 16, 32, 64}),
                                                                   "one of {1, 8, 16, 32, 64}"), src="doc"),
    TargetRule("SA-T7", GRAD, frozenset({A5}), _block_size(frozenset({1}), "1")),
    TargetRule("SG-T8", GRAD, frozenset({A2, A3}), _in_set("K", frozenset(range(1024, 8193, 1024)),
                                                             "{1024, 2048, ..., 8192}"), src="doc (A2/A3 tiling runs K = 4, 8)"),
    TargetRule("SG-T8", GRAD, frozenset({A5}), _in_set("K", frozenset(range(1024, 8193, 1024)),
                                                       "{1024, 2048, ..., 8192}"), src="code (950 tiling)"),
    TargetRule("SF-T9", FORWARD, ASCEND_TRAINING, _unbounded_tokens),
    # issue 27, item 3: the code refuses it (op_host/op_api/aclnn_sparse_flash_attention_v2.cpp: sinks off
    # DAV_3510 -> ACLNN_ERR_RUNTIME_ERROR 361001; op_api UT sparse_flash_attention_v2_aclnn_a3_sinks_not_supported)
    TargetRule("SF-T10", FORWARD, frozenset({A2, A3}), _no_sinks, src="code (op_api V2: 361001)"),
    TargetRule("SG-T11", GRAD, frozenset({A5}), _value_present),
    TargetRule("SG-T12", GRAD, ASCEND_TRAINING, _grad_extents, src="doc"),
    TargetRule("SG-T13", GRAD, ASCEND_TRAINING, _value_is_key, src="doc (value and key identical)"),
    TargetRule("SG-W2", GRAD, ASCEND_TRAINING, _selection_memory, src="doc", warning=True),
    TargetRule("PA-S6", FORWARD, frozenset({A5}), _paged_on_950),
)
