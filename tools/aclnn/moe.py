"""``aclnnMoeTokenUnpermute`` and ``aclnnMoeTokenUnpermuteGrad``: the MoE combine's aclnn pair.

Signatures as CANN's (``moe/moe_token_unpermute[_grad]/docs``, the generated ``aclnn_moe_token_unpermute*.h``).
``probsOptional`` null: no weights, and the grad writes no ``probsGradOut``. ``restoreShapeOptional`` is accepted
and ignored (as the op's attribute). The inputs may be non-contiguous views (the docs' "支持非连续"); outputs are
contiguous. Statuses as the docs and ``op_api`` state them: null 161001, data type or format 161002, shapes that
disagree 561002 (the tiling's). The grad null-checks ``permutedTokens`` and ``probsGradOut`` whether or not probs
is given (``op_api``'s ``CheckNotNull``).

On ascend950 CANN routes these APIs to MoeFinalizeRoutingV2(Grad): the graph path's "no ascend950 kernel" rows
(MU-T1, MG-T1) do not apply, and ``paddedMode`` true is refused (161002) before any other check.
"""

from __future__ import annotations

from ...ir._core import Graph
from ...ir._dtypes import DType
from ._context import DeviceBuffer, aclrtStream
from ._executor import StatusRules, TensorArg, aclOpExecutor, execute, int_array, prepare
from ...schemas.targets import A5
from ._context import CONTEXT
from ._status import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, AclnnFailure, record_error
from ._tensor import aclIntArray, aclTensor

__all__ = ["aclnnMoeTokenUnpermute", "aclnnMoeTokenUnpermuteGetWorkspaceSize", "aclnnMoeTokenUnpermuteGrad",
           "aclnnMoeTokenUnpermuteGradGetWorkspaceSize"]

_RULES = StatusRules(semantic=ACLNN_ERR_INNER_TILING_ERROR, skipped=frozenset({"MU-T1", "MG-T1"}))
_POINTER, _FLOAT = 8, 4
_FLOATS = (DType.FLOAT16, DType.FLOAT32, DType.BFLOAT16)


def _hidden(graph: Graph) -> int:
    return int(graph.outputs[0].type.shape[1])


def _forward_workspace(graph: Graph) -> int:
    """The native kernel's scratch for one task: a row pointer and a weight per slot of a token, two float32 rows."""
    node = graph.nodes[0]
    probs = node.inputs[2]
    k = int(probs.type.shape[1]) if probs is not None else 1
    return k * (_POINTER + _FLOAT) + (2 * _hidden(graph) + 1) * _FLOAT


def _grad_workspace(graph: Graph) -> int:
    """The native kernel's scratch: the slot of every row (int32), and one task's two float32 rows."""
    m = int(graph.outputs[0].type.shape[0])
    return m * 4 + (2 * _hidden(graph) + 1) * _FLOAT


def _attributes(api: str, padded_mode: bool, restore_shape: aclIntArray | None) -> dict[str, object]:
    if padded_mode and CONTEXT.target == A5:
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, "paddedMode: expected false (ascend950's op_api refuses true "
                           "before any other check), got true")
    shape = int_array("restoreShapeOptional", restore_shape)
    attributes: dict[str, object] = {"padded_mode": padded_mode}
    if shape is not None:
        attributes["restore_shape"] = list(shape)
    return attributes


def aclnnMoeTokenUnpermuteGetWorkspaceSize(permutedTokens: aclTensor | None, sortedIndices: aclTensor | None,
                                           probsOptional: aclTensor | None, paddedMode: bool,
                                           restoreShapeOptional: aclIntArray | None, out: aclTensor | None
                                           ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of the combine: ``out[t] = sum_k probs[t, k] * permutedTokens[sortedIndices[t*K + k]]``."""
    api = "aclnnMoeTokenUnpermute"
    try:
        attributes = _attributes(api, paddedMode, restoreShapeOptional)
    except AclnnFailure as failure:
        return record_error(api + "GetWorkspaceSize", failure), 0, None
    inputs = [TensorArg("permutedTokens", "permuted_tokens", permutedTokens, strided=True),
              TensorArg("sortedIndices", "sorted_indices", sortedIndices, strided=True),
              TensorArg("probsOptional", "probs", probsOptional, required=False, strided=True)]
    return prepare(api, "MoeTokenUnpermute", inputs, attributes,
                   [TensorArg("out", "unpermuted_tokens", out)], _RULES, workspace=_forward_workspace)


def aclnnMoeTokenUnpermute(workspace: DeviceBuffer | None, workspaceSize: int, executor: aclOpExecutor | None,
                           stream: aclrtStream | None) -> int:
    return execute("aclnnMoeTokenUnpermute", workspace, workspaceSize, executor, stream)


def aclnnMoeTokenUnpermuteGradGetWorkspaceSize(permutedTokens: aclTensor | None,
                                               unpermutedTokensGrad: aclTensor | None,
                                               sortedIndices: aclTensor | None, probsOptional: aclTensor | None,
                                               paddedMode: bool, restoreShapeOptional: aclIntArray | None,
                                               permutedTokensGradOut: aclTensor | None,
                                               probsGradOut: aclTensor | None
                                               ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of the combine's gradient (rows' and, with probs, the weights')."""
    api = "aclnnMoeTokenUnpermuteGrad"
    try:
        attributes = _attributes(api, paddedMode, restoreShapeOptional)
    except AclnnFailure as failure:
        return record_error(api + "GetWorkspaceSize", failure), 0, None
    inputs = [TensorArg("permutedTokens", "permuted_tokens", permutedTokens, strided=True),
              TensorArg("unpermutedTokensGrad", "unpermuted_tokens_grad", unpermutedTokensGrad, strided=True),
              TensorArg("sortedIndices", "sorted_indices", sortedIndices, strided=True),
              TensorArg("probsOptional", "probs", probsOptional, required=False, strided=True)]
    outputs = [TensorArg("permutedTokensGradOut", "permuted_tokens_grad", permutedTokensGradOut),
               TensorArg("probsGradOut", "probs_grad", probsGradOut, written=probsOptional is not None,
                         dtypes=_FLOATS)]
    return prepare(api, "MoeTokenUnpermuteGrad", inputs, attributes, outputs, _RULES, workspace=_grad_workspace)


def aclnnMoeTokenUnpermuteGrad(workspace: DeviceBuffer | None, workspaceSize: int, executor: aclOpExecutor | None,
                               stream: aclrtStream | None) -> int:
    return execute("aclnnMoeTokenUnpermuteGrad", workspace, workspaceSize, executor, stream)
