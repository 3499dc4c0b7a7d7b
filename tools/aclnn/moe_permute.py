"""``aclnnMoeTokenPermute`` and ``aclnnMoeTokenPermuteGrad``: the MoE dispatch's aclnn pair.

Signatures as CANN's (``moe/moe_token_permute[_grad]``: docs, ``op_api``). The permute null-checks its four tensors
before anything else, on every device (``MoeTokenPermuteCheck::CheckNotNull``); on ascend950 ``paddedMode`` true is
then 161002, and on Atlas A2/A3 the tiling refuses it (561002, the doc's row). The grad checks ``paddedMode`` first
on ascend950 (161002), then nulls. Data type 161002; shapes (tokens rank, indices against tokens) 561002. Inputs
may be non-contiguous (the docs' "支持非连续"); the permute's outputs are contiguous, the grad's ``out`` may be a
strided view too (its doc marks it "√").
"""

from __future__ import annotations

from ...ir._core import Graph
from ...schemas.targets import A5
from ._context import CONTEXT, DeviceBuffer, aclrtStream
from ._executor import StatusRules, TensorArg, aclOpExecutor, execute, prepare
from ._status import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, AclnnFailure, record_error
from ._tensor import aclTensor

__all__ = ["aclnnMoeTokenPermute", "aclnnMoeTokenPermuteGetWorkspaceSize", "aclnnMoeTokenPermuteGrad",
           "aclnnMoeTokenPermuteGradGetWorkspaceSize"]

_RULES = StatusRules(semantic=ACLNN_ERR_INNER_TILING_ERROR, skipped=frozenset({"MPG-T1"}))
"""MPG-T1 is the graph path's "no ascend950 kernel": the aclnn API routes to MoeInitRoutingV2Grad there."""
_RADIX = 1 << 13


def _slots(graph: Graph) -> int:
    """M: the grad's len(sorted_indices), the permute's tokens * topK (every element of indices)."""
    shapes = {v.name: v.type.shape for v in graph.inputs}
    if "sorted_indices" in shapes:
        return int(shapes["sorted_indices"][0])
    count = 1
    for d in shapes["indices"]:
        count *= int(d)
    return count


def _permute_workspace(graph: Graph) -> int:
    """The native kernel's scratch: per slot a sort key (uint32), its row and a radix pass's copy (int64), and
    the radix counts."""
    return _slots(graph) * (4 + 8 + 8) + (_RADIX + 1) * 8


def _grad_workspace(graph: Graph) -> int:
    """The native kernel's scratch: a seen-flag per slot, and one task's two float32 rows."""
    hidden = int(graph.outputs[0].type.shape[1])
    return _slots(graph) + (2 * hidden + 1) * 4


def _padded_mode_on_ascend950(padded_mode: bool) -> None:
    if padded_mode and CONTEXT.target == A5:
        raise AclnnFailure(ACLNN_ERR_PARAM_INVALID, "paddedMode: expected false (ascend950's op_api refuses true), "
                           "got true")


def aclnnMoeTokenPermuteGetWorkspaceSize(tokens: aclTensor | None, indices: aclTensor | None, numOutTokens: int,
                                         paddedMode: bool, permuteTokensOut: aclTensor | None,
                                         sortedIndicesOut: aclTensor | None
                                         ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of the dispatch: each token's K copies sorted by expert id (stable), and slot -> row indices."""
    api = "aclnnMoeTokenPermute"
    args = [TensorArg("tokens", "tokens", tokens, strided=True), TensorArg("indices", "indices", indices, strided=True)]
    outputs = [TensorArg("permuteTokensOut", "permute_tokens", permuteTokensOut),
               TensorArg("sortedIndicesOut", "sorted_indices", sortedIndicesOut)]
    try:
        for arg in (*args, *outputs):
            if arg.tensor is None:
                raise AclnnFailure(161001, f"{arg.name}: expected a tensor, got a null pointer (None)")
        _padded_mode_on_ascend950(paddedMode)
    except AclnnFailure as failure:
        return record_error(api + "GetWorkspaceSize", failure), 0, None
    return prepare(api, "MoeTokenPermute", args, {"num_out_tokens": numOutTokens, "padded_mode": paddedMode},
                   outputs, _RULES, workspace=_permute_workspace)


def aclnnMoeTokenPermute(workspace: DeviceBuffer | None, workspaceSize: int, executor: aclOpExecutor | None,
                         stream: aclrtStream | None) -> int:
    return execute("aclnnMoeTokenPermute", workspace, workspaceSize, executor, stream)


def aclnnMoeTokenPermuteGradGetWorkspaceSize(permutedOutputGrad: aclTensor | None, sortedIndices: aclTensor | None,
                                             numTopk: int, paddedMode: bool, out: aclTensor | None
                                             ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of the dispatch's gradient: each token's K gradient rows summed (float32, k in order)."""
    api = "aclnnMoeTokenPermuteGrad"
    try:
        _padded_mode_on_ascend950(paddedMode)
    except AclnnFailure as failure:
        return record_error(api + "GetWorkspaceSize", failure), 0, None
    args = [TensorArg("permutedOutputGrad", "permuted_output_grad", permutedOutputGrad, strided=True),
            TensorArg("sortedIndices", "sorted_indices", sortedIndices, strided=True)]
    return prepare(api, "MoeTokenPermuteGrad", args, {"num_topk": numTopk, "padded_mode": paddedMode},
                   [TensorArg("out", "input_grad", out, strided=True)], _RULES, workspace=_grad_workspace)


def aclnnMoeTokenPermuteGrad(workspace: DeviceBuffer | None, workspaceSize: int, executor: aclOpExecutor | None,
                             stream: aclrtStream | None) -> int:
    return execute("aclnnMoeTokenPermuteGrad", workspace, workspaceSize, executor, stream)
