"""``aclnnSparseFlashAttention`` (V1 and V2, with sinks) and ``aclnnSparseFlashAttentionGrad``.

Signatures as CANN's (``attention/sparse_flash_attention[_grad]``: docs, ``op_api``, examples). Null-pointer
conventions: forward ``value`` null reads ``key`` as the value; ``returnSoftmaxLse`` false takes null statistics
outputs (and writes none), true needs both (161001); grad ``value``/``dValueOut`` null is the KV merge; a null
layout string is "BSND"; V2 has no placeholder statistics, so it needs ``softmaxMax``/``softmaxSum`` tensors even
when ``returnSoftmaxLse`` is false. Statuses: data type or format 161002, the op's shape and attribute rules 561002
(the tiling's), V2's sinks anywhere but ascend950 361001, checked first (CANN's op_api, UT a3_sinks_not_supported).
Where CANN's op_api returns ``ge::GRAPH_FAILED`` for missing statistics outputs (it logs ACLNN_ERR_PARAM_NULLPTR),
geir returns that logged status, 161001.

Tensors are contiguous except V1's ``key``/``value``/``keyRopeOptional`` of a paged cache (PA_BSND) on ascend950,
which may be strided along axis 0 (their pages); V2's doc marks them contiguous-only. An empty ``query`` makes the
grad return at once, as its doc says; the forward refuses it (its doc: "不支持空tensor").
"""

from __future__ import annotations

from ...ir._core import Graph
from ...schemas.targets import A5
from ._context import CONTEXT, DeviceBuffer, aclrtStream
from ._executor import StatusRules, TensorArg, aclOpExecutor, execute, prepare
from ._status import (ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR,
                      ACLNN_ERR_RUNTIME_ERROR, AclnnFailure, record_error)
from ._tensor import aclTensor

__all__ = ["aclnnSparseFlashAttention", "aclnnSparseFlashAttentionGetWorkspaceSize", "aclnnSparseFlashAttentionGrad",
           "aclnnSparseFlashAttentionGradGetWorkspaceSize", "aclnnSparseFlashAttentionV2",
           "aclnnSparseFlashAttentionV2GetWorkspaceSize"]

_RULES = StatusRules(semantic=ACLNN_ERR_INNER_TILING_ERROR, device=ACLNN_ERR_INNER_TILING_ERROR,
                     codes={"SF-T10": ACLNN_ERR_RUNTIME_ERROR})
_FLOAT = 4
_INT64_MAX = 2**63 - 1


def _shapes(graph: Graph) -> dict[str, tuple[int, ...]]:
    return {v.name: tuple(int(d) for d in v.type.shape) for v in graph.inputs}


def _elements(shapes: dict[str, tuple[int, ...]], *names: str) -> int:
    total = 0
    for name in names:
        count = 1
        for d in shapes.get(name, (0,)):
            count *= d
        total += count
    return total


def _task_floats(graph: Graph, shapes: dict[str, tuple[int, ...]]) -> int:
    """One task's scratch: the scores of a head group over its selected keys, its query rows, output and stats."""
    heads, d = shapes["query"][-2], shapes["query"][-1]
    selected = shapes["sparse_indices"][-1] * int(graph.nodes[0].attributes.get("sparse_block_size", 1))
    return selected * heads + 3 * d * heads + 2 * heads


def _forward_workspace(graph: Graph) -> int:
    """float32 copies of the keys and values the kernel widens, plus one task's scratch."""
    shapes = _shapes(graph)
    return (_elements(shapes, "key", "key_rope", "value") + _task_floats(graph, shapes)) * _FLOAT


def _grad_workspace(graph: Graph) -> int:
    """The forward's, plus float32 accumulators for d_key, d_key_rope and d_value."""
    shapes = _shapes(graph)
    return (2 * _elements(shapes, "key", "key_rope", "value") + _task_floats(graph, shapes)) * _FLOAT


def _layout(name: str, value: str | None) -> str:
    if value is None:
        return "BSND"
    if not isinstance(value, str):
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{name}: expected a layout string or None, got {value!r}")
    return value


def _lengths(query: aclTensor | None, kv: aclTensor | None) -> tuple[TensorArg, TensorArg]:
    return (TensorArg("actualSeqLengthsQueryOptional", "actual_seq_lengths_query", query, required=False),
            TensorArg("actualSeqLengthsKvOptional", "actual_seq_lengths_kv", kv, required=False))


def _paged_views(api: str, layout_kv: str) -> bool:
    """V1's key and value may be strided along axis 0 (pages) only for a paged cache on ascend950."""
    return api == "aclnnSparseFlashAttention" and layout_kv == "PA_BSND" and CONTEXT.target == A5


def _check_page_strides(args: list[TensorArg]) -> None:
    for arg in args:
        t = arg.tensor
        if t is None or not isinstance(t, aclTensor) or t.is_contiguous():
            continue
        inner = 1
        for size, stride in zip(reversed(t.shape[1:]), reversed(t.strides[1:])):
            if size != 1 and stride != inner:
                raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: a paged cache may be strided along axis "
                                   f"0 only (its pages), got shape {list(t.shape)} with strides {list(t.strides)}")
            inner *= size
        if t.strides[0] < inner:
            raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, f"{arg.name}: pages overlap: axis 0 stride {t.strides[0]} "
                               f"is below a page's {inner} elements")


def _forward(api: str, query: aclTensor | None, key: aclTensor | None, value: aclTensor | None,
             sparseIndices: aclTensor | None, blockTableOptional: aclTensor | None,
             actualSeqLengthsQueryOptional: aclTensor | None, actualSeqLengthsKvOptional: aclTensor | None,
             queryRopeOptional: aclTensor | None, keyRopeOptional: aclTensor | None, sinksOptional: aclTensor | None,
             scaleValue: float, sparseBlockSize: int, layoutQueryOptional: str | None, layoutKvOptional: str | None,
             sparseMode: int, preTokens: int, nextTokens: int, attentionMode: int, returnSoftmaxLse: bool,
             attentionOut: aclTensor | None, softmaxMax: aclTensor | None, softmaxSum: aclTensor | None
             ) -> tuple[int, int, aclOpExecutor | None]:
    try:
        if sinksOptional is not None and CONTEXT.target is not None and CONTEXT.target != A5:
            raise AclnnFailure(ACLNN_ERR_RUNTIME_ERROR, f"sinksOptional: sinks are supported on ascend950 only, "
                               f"the device is {CONTEXT.target} (CANN op_api, UT a3_sinks_not_supported)")
        layout_query = _layout("layoutQueryOptional", layoutQueryOptional)
        layout_kv = _layout("layoutKvOptional", layoutKvOptional)
        paged = _paged_views(api, layout_kv)
        kv = [TensorArg("key", "key", key, strided=paged),
              TensorArg("value", "value", value if value is not None else key, strided=paged),
              TensorArg("keyRopeOptional", "key_rope", keyRopeOptional, required=False, strided=paged)]
        if paged:
            _check_page_strides(kv)
        if returnSoftmaxLse and (softmaxMax is None or softmaxSum is None):
            missing = "softmaxMax" if softmaxMax is None else "softmaxSum"
            raise AclnnFailure(ACLNN_ERR_PARAM_NULLPTR, f"{missing}: expected a tensor when returnSoftmaxLse is "
                               f"true, got a null pointer (None)")
        if api.endswith("V2") and softmaxMax is None and softmaxSum is None:
            raise AclnnFailure(ACLNN_ERR_PARAM_NULLPTR, "softmaxMax, softmaxSum: expected tensors (V2 has no "
                               "placeholder statistics, even with returnSoftmaxLse false), got null pointers")
    except AclnnFailure as failure:
        return record_error(api + "GetWorkspaceSize", failure), 0, None
    inputs = [TensorArg("query", "query", query), kv[0], kv[1],
              TensorArg("sparseIndices", "sparse_indices", sparseIndices),
              TensorArg("blockTableOptional", "block_table", blockTableOptional, required=False),
              *_lengths(actualSeqLengthsQueryOptional, actualSeqLengthsKvOptional),
              TensorArg("queryRopeOptional", "query_rope", queryRopeOptional, required=False), kv[2],
              TensorArg("sinksOptional", "sinks", sinksOptional, required=False)]
    attributes = {"scale_value": scaleValue, "sparse_block_size": sparseBlockSize, "layout_query": layout_query,
                  "layout_kv": layout_kv, "sparse_mode": sparseMode, "pre_tokens": preTokens,
                  "next_tokens": nextTokens, "attention_mode": attentionMode, "return_softmax_lse": returnSoftmaxLse}
    outputs = [TensorArg("attentionOut", "attention_out", attentionOut)]
    if returnSoftmaxLse:
        outputs += [TensorArg("softmaxMax", "softmax_max", softmaxMax),
                    TensorArg("softmaxSum", "softmax_sum", softmaxSum)]
    return prepare(api, "SparseFlashAttention", inputs, attributes, outputs, _RULES, workspace=_forward_workspace)


def aclnnSparseFlashAttentionGetWorkspaceSize(
        query: aclTensor | None, key: aclTensor | None, value: aclTensor | None, sparseIndices: aclTensor | None,
        blockTableOptional: aclTensor | None, actualSeqLengthsQueryOptional: aclTensor | None,
        actualSeqLengthsKvOptional: aclTensor | None, queryRopeOptional: aclTensor | None,
        keyRopeOptional: aclTensor | None, scaleValue: float, sparseBlockSize: int = 1,
        layoutQueryOptional: str | None = "BSND", layoutKvOptional: str | None = "BSND", sparseMode: int = 3,
        preTokens: int = _INT64_MAX, nextTokens: int = _INT64_MAX, attentionMode: int = 0,
        returnSoftmaxLse: bool = False, attentionOut: aclTensor | None = None, softmaxMax: aclTensor | None = None,
        softmaxSum: aclTensor | None = None) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of the sparse attention forward: ``(status, workspace_size, executor)``.

    The run writes ``attentionOut`` and, with ``returnSoftmaxLse`` true, ``softmaxMax``/``softmaxSum`` (float32
    ``(B, N2, S1, G)`` / ``(N2, T1, G)``; a null one is 161001). With it false the statistics are not computed: they
    may be null (None), and tensors given there are not written (they keep their contents)."""
    return _forward("aclnnSparseFlashAttention", query, key, value, sparseIndices, blockTableOptional,
                    actualSeqLengthsQueryOptional, actualSeqLengthsKvOptional, queryRopeOptional, keyRopeOptional,
                    None, scaleValue, sparseBlockSize, layoutQueryOptional, layoutKvOptional, sparseMode, preTokens,
                    nextTokens, attentionMode, returnSoftmaxLse, attentionOut, softmaxMax, softmaxSum)


def aclnnSparseFlashAttention(workspace: DeviceBuffer | None, workspaceSize: int, executor: aclOpExecutor | None,
                              stream: aclrtStream | None) -> int:
    return execute("aclnnSparseFlashAttention", workspace, workspaceSize, executor, stream)


def aclnnSparseFlashAttentionV2GetWorkspaceSize(
        query: aclTensor | None, key: aclTensor | None, value: aclTensor | None, sparseIndices: aclTensor | None,
        blockTableOptional: aclTensor | None, actualSeqLengthsQueryOptional: aclTensor | None,
        actualSeqLengthsKvOptional: aclTensor | None, queryRopeOptional: aclTensor | None,
        keyRopeOptional: aclTensor | None, sinksOptional: aclTensor | None, scaleValue: float,
        sparseBlockSize: int = 1, layoutQueryOptional: str | None = "BSND", layoutKvOptional: str | None = "BSND",
        sparseMode: int = 3, preTokens: int = _INT64_MAX, nextTokens: int = _INT64_MAX, attentionMode: int = 0,
        returnSoftmaxLse: bool = False, attentionOut: aclTensor | None = None, softmaxMax: aclTensor | None = None,
        softmaxSum: aclTensor | None = None) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of V2: V1 plus ``sinksOptional`` (N1,) float32 per-head sink logits (ascend950 only).

    ``softmaxMax``/``softmaxSum`` must be tensors even when ``returnSoftmaxLse`` is false (null is 161001); they are
    written only when it is true, as V1's."""
    return _forward("aclnnSparseFlashAttentionV2", query, key, value, sparseIndices, blockTableOptional,
                    actualSeqLengthsQueryOptional, actualSeqLengthsKvOptional, queryRopeOptional, keyRopeOptional,
                    sinksOptional, scaleValue, sparseBlockSize, layoutQueryOptional, layoutKvOptional, sparseMode,
                    preTokens, nextTokens, attentionMode, returnSoftmaxLse, attentionOut, softmaxMax, softmaxSum)


def aclnnSparseFlashAttentionV2(workspace: DeviceBuffer | None, workspaceSize: int, executor: aclOpExecutor | None,
                                stream: aclrtStream | None) -> int:
    return execute("aclnnSparseFlashAttentionV2", workspace, workspaceSize, executor, stream)


def aclnnSparseFlashAttentionGradGetWorkspaceSize(
        query: aclTensor | None, key: aclTensor | None, value: aclTensor | None, sparseIndices: aclTensor | None,
        dOut: aclTensor | None, out: aclTensor | None, softmaxMax: aclTensor | None, softmaxSum: aclTensor | None,
        actualSeqLengthsQueryOptional: aclTensor | None, actualSeqLengthsKvOptional: aclTensor | None,
        queryRopeOptional: aclTensor | None, keyRopeOptional: aclTensor | None, scaleValue: float,
        sparseBlockSize: int = 1, layoutOptional: str | None = "BSND", sparseMode: int = 3,
        preTokens: int = 2147483647, nextTokens: int = 2147483647, deterministic: bool = False,
        dQueryOut: aclTensor | None = None, dKeyOut: aclTensor | None = None, dValueOut: aclTensor | None = None,
        dQueryRopeOutOptional: aclTensor | None = None, dKeyRopeOutOptional: aclTensor | None = None
        ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of the sparse attention gradient: ``(status, workspace_size, executor)``."""
    api = "aclnnSparseFlashAttentionGrad"
    try:
        layout = _layout("layoutOptional", layoutOptional)
    except AclnnFailure as failure:
        return record_error(api + "GetWorkspaceSize", failure), 0, None
    rope = queryRopeOptional is not None or keyRopeOptional is not None
    inputs = [TensorArg("query", "query", query), TensorArg("key", "key", key),
              TensorArg("sparseIndices", "sparse_indices", sparseIndices), TensorArg("dOut", "d_out", dOut),
              TensorArg("out", "out", out), TensorArg("softmaxMax", "softmax_max", softmaxMax),
              TensorArg("softmaxSum", "softmax_sum", softmaxSum),
              TensorArg("value", "value", value, required=False),
              *_lengths(actualSeqLengthsQueryOptional, actualSeqLengthsKvOptional),
              TensorArg("queryRopeOptional", "query_rope", queryRopeOptional, required=False),
              TensorArg("keyRopeOptional", "key_rope", keyRopeOptional, required=False)]
    if value is None and dValueOut is not None:
        return record_error(api + "GetWorkspaceSize", AclnnFailure(ACLNN_ERR_PARAM_INVALID, "dValueOut: expected a "
                            "null pointer with a null value (the KV merge adds dV into dKeyOut), got a tensor")), 0, None
    outputs = [TensorArg("dQueryOut", "d_query", dQueryOut), TensorArg("dKeyOut", "d_key", dKeyOut)]
    if value is not None:
        outputs.append(TensorArg("dValueOut", "d_value", dValueOut))
    if rope:
        outputs += [TensorArg("dQueryRopeOutOptional", "d_query_rope", dQueryRopeOutOptional),
                    TensorArg("dKeyRopeOutOptional", "d_key_rope", dKeyRopeOutOptional)]
    attributes = {"scale_value": scaleValue, "sparse_block_size": sparseBlockSize, "layout": layout,
                  "sparse_mode": sparseMode, "pre_tokens": preTokens, "next_tokens": nextTokens,
                  "deterministic": deterministic}
    return prepare(api, "SparseFlashAttentionGrad", inputs, attributes, outputs, _RULES, workspace=_grad_workspace,
                   no_op=lambda: isinstance(query, aclTensor) and query.is_empty())


def aclnnSparseFlashAttentionGrad(workspace: DeviceBuffer | None, workspaceSize: int, executor: aclOpExecutor | None,
                                  stream: aclrtStream | None) -> int:
    return execute("aclnnSparseFlashAttentionGrad", workspace, workspaceSize, executor, stream)
