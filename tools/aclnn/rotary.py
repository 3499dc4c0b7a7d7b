"""``aclnnInplacePartialRotaryMul`` and ``aclnnInplacePartialRotaryMulGrad``: the rotary ops' aclnn pair.

Signatures as CANN's (``posembedding/inplace_partial_rotary_mul[_grad]/docs``): ``xRef``/``dyRef`` is read and
overwritten in place, through the caller's tensor; ``partialSlice`` null is the whole last axis ``[0, D]``.
Statuses as each doc's table states them: null ``xRef``/``dyRef``/``cos``/``sin`` 161001; a data type or format
outside the lists 161002; the forward's other refusals (mode, slice, shapes) 161002 too (its table has no 561002
row); the grad's shape constraints and ``rotaryMode`` outside 0..3 561002. The tensors are contiguous only (the
non-contiguous column is "×" for all three): a strided view is 161002. The grad's doc makes an empty ``dyRef``,
``cos`` or ``sin`` (a dim of 0) a no-op (its arch35 tiling's no-op key): the op's own semantics since RP-S6 binds
only the forward, so every other rule still applies and the run leaves ``dyRef`` as it is.
"""

from __future__ import annotations

from ...ir._core import Graph
from ._context import DeviceBuffer, aclrtStream
from ._executor import StatusRules, TensorArg, aclOpExecutor, execute, int_array, prepare
from ._status import (ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_RUNTIME_ERROR, AclnnFailure,
                      record_error)
from ._tensor import aclIntArray, aclTensor

__all__ = ["aclnnInplacePartialRotaryMul", "aclnnInplacePartialRotaryMulGetWorkspaceSize",
           "aclnnInplacePartialRotaryMulGrad", "aclnnInplacePartialRotaryMulGradGetWorkspaceSize"]

_FORWARD_RULES = StatusRules(semantic=ACLNN_ERR_PARAM_INVALID, device=ACLNN_ERR_PARAM_INVALID)
_GRAD_RULES = StatusRules(semantic=ACLNN_ERR_INNER_TILING_ERROR, device=ACLNN_ERR_INNER_TILING_ERROR,
                          codes={"RP-T1": ACLNN_ERR_RUNTIME_ERROR})
"""RP-T1 (no grad kernel on Atlas A2/A3): the API has nothing to launch there."""


def _no_workspace(graph: Graph) -> int:
    """The rotary kernels rotate rows in registers: no scratch."""
    return 0


def _prepare(api: str, op_type: str, in_name: str, key: str, ref: aclTensor | None, cos: aclTensor | None,
             sin: aclTensor | None, rotary_mode: int, partial_slice: aclIntArray | None, is_grad: bool
             ) -> tuple[int, int, aclOpExecutor | None]:
    try:
        bounds = int_array("partialSlice", partial_slice)
    except AclnnFailure as failure:
        return record_error(api + "GetWorkspaceSize", failure), 0, None
    if bounds is None and isinstance(ref, aclTensor) and len(ref.shape) == 4:
        bounds = (0, ref.shape[3])        # null partialSlice: the whole last axis
    inputs = [TensorArg(in_name, key, ref), TensorArg("cos", "cos", cos), TensorArg("sin", "sin", sin)]
    attributes = {"rotary_mode": rotary_mode, "partial_slice": list(bounds) if bounds is not None else [0, 0]}
    rules = _GRAD_RULES if is_grad else _FORWARD_RULES
    return prepare(api, op_type, inputs, attributes, [TensorArg(in_name, key, ref)], rules, workspace=_no_workspace)


def aclnnInplacePartialRotaryMulGetWorkspaceSize(xRef: aclTensor | None, cos: aclTensor | None,
                                                 sin: aclTensor | None, rotaryMode: int,
                                                 partialSlice: aclIntArray | None
                                                 ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of the rotary forward on ``xRef[..., start:end]``, in place: ``(status, workspace, executor)``."""
    return _prepare("aclnnInplacePartialRotaryMul", "InplacePartialRotaryMul", "xRef", "x", xRef, cos, sin,
                    rotaryMode, partialSlice, False)


def aclnnInplacePartialRotaryMul(workspace: DeviceBuffer | None, workspaceSize: int, executor: aclOpExecutor | None,
                                 stream: aclrtStream | None) -> int:
    """Phase two: rotate ``xRef`` in place; returns the status."""
    return execute("aclnnInplacePartialRotaryMul", workspace, workspaceSize, executor, stream)


def aclnnInplacePartialRotaryMulGradGetWorkspaceSize(dyRef: aclTensor | None, cos: aclTensor | None,
                                                     sin: aclTensor | None, rotaryMode: int,
                                                     partialSlice: aclIntArray | None
                                                     ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase one of the rotary gradient on ``dyRef[..., start:end]``, in place: ``(status, workspace, executor)``."""
    return _prepare("aclnnInplacePartialRotaryMulGrad", "InplacePartialRotaryMulGrad", "dyRef", "dy", dyRef, cos,
                    sin, rotaryMode, partialSlice, True)


def aclnnInplacePartialRotaryMulGrad(workspace: DeviceBuffer | None, workspaceSize: int,
                                     executor: aclOpExecutor | None, stream: aclrtStream | None) -> int:
    """Phase two: overwrite ``dyRef`` with the gradient of the forward's input; returns the status."""
    return execute("aclnnInplacePartialRotaryMulGrad", workspace, workspaceSize, executor, stream)
