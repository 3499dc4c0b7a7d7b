"""``geir.aclnn``: CANN's single-op call path (aclnn) in Python, for the ops geir knows.

Every aclnn API is two calls: ``aclnnXxxGetWorkspaceSize(<CANN's parameters in CANN's order>)`` returns
``(status, workspace_size, executor)``; ``aclnnXxx(workspace, workspace_size, executor, stream)`` runs it and
returns the status. Status codes, null-pointer (``None``) conventions, strided views, in-place writes and
single-use executors follow CANN's docs and ``op_api`` code, so a test ported from CANN's ``test_aclnn_*``
examples reads line for line::

    from geir import aclnn
    aclnn.aclInit(None, target="ascend950")
    stream = aclnn.aclrtCreateStream()
    dy = aclnn.aclCreateTensor(dy_array)                       # a view of dy_array: written in place
    status, size, executor = aclnn.aclnnInplacePartialRotaryMulGradGetWorkspaceSize(
        dy, aclnn.aclCreateTensor(cos), aclnn.aclCreateTensor(sin), 1, aclnn.aclCreateIntArray([0, 128]))
    workspace = aclnn.aclrtMalloc(size)
    status = aclnn.aclnnInplacePartialRotaryMulGrad(workspace, size, executor, stream)

A failed call returns its status and keeps the reason (the parameter, the rule, expected and actual) for
``aclnn.aclGetRecentErrMsg()``. ``aclInit(target=...)`` chooses the device whose rules apply (as ``geir.check``)
and ``runtime=`` the geir runtime that computes.
"""

from __future__ import annotations

from ._context import (DeviceBuffer, aclFinalize, aclInit, aclrtCreateStream, aclrtDestroyStream, aclrtFree,
                       aclrtGetSocName, aclrtMalloc, aclrtResetDevice, aclrtSetDevice, aclrtStream,
                       aclrtSynchronizeStream)
from ._executor import aclDestroyAclOpExecutor, aclOpExecutor, aclSetAclOpExecutorRepeatable
from ._status import (ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR,
                      ACLNN_ERR_RUNTIME_ERROR, ACLNN_SUCCESS, aclGetRecentErrMsg, status_name)
from ._tensor import (ACL_BF16, ACL_BOOL, ACL_DOUBLE, ACL_FLOAT, ACL_FLOAT16, ACL_FORMAT_FRACTAL_NZ,
                      ACL_FORMAT_NC1HWC0, ACL_FORMAT_NCHW, ACL_FORMAT_ND, ACL_FORMAT_NHWC, ACL_INT8, ACL_INT16,
                      ACL_INT32, ACL_INT64, ACL_UINT8, ACL_UINT16, ACL_UINT32, ACL_UINT64, aclCreateIntArray,
                      aclCreateTensor, aclDestroyIntArray, aclDestroyTensor, aclGetDataType, aclGetFormat,
                      aclGetViewOffset, aclGetViewShape, aclGetViewStrides, aclIntArray, aclTensor)
from .moe import (aclnnMoeTokenUnpermute, aclnnMoeTokenUnpermuteGetWorkspaceSize, aclnnMoeTokenUnpermuteGrad,
                  aclnnMoeTokenUnpermuteGradGetWorkspaceSize)
from .moe_permute import (aclnnMoeTokenPermute, aclnnMoeTokenPermuteGetWorkspaceSize, aclnnMoeTokenPermuteGrad,
                          aclnnMoeTokenPermuteGradGetWorkspaceSize)
from .rotary import (aclnnInplacePartialRotaryMul, aclnnInplacePartialRotaryMulGetWorkspaceSize,
                     aclnnInplacePartialRotaryMulGrad, aclnnInplacePartialRotaryMulGradGetWorkspaceSize)
from .sparse_attention import (aclnnSparseFlashAttention, aclnnSparseFlashAttentionGetWorkspaceSize,
                               aclnnSparseFlashAttentionGrad, aclnnSparseFlashAttentionGradGetWorkspaceSize,
                               aclnnSparseFlashAttentionV2, aclnnSparseFlashAttentionV2GetWorkspaceSize)

__all__ = [
    "ACLNN_ERR_INNER_TILING_ERROR", "ACLNN_ERR_PARAM_INVALID", "ACLNN_ERR_PARAM_NULLPTR", "ACLNN_ERR_RUNTIME_ERROR",
    "ACLNN_SUCCESS", "ACL_BF16", "ACL_BOOL", "ACL_DOUBLE", "ACL_FLOAT", "ACL_FLOAT16", "ACL_FORMAT_FRACTAL_NZ",
    "ACL_FORMAT_NC1HWC0", "ACL_FORMAT_NCHW", "ACL_FORMAT_ND", "ACL_FORMAT_NHWC", "ACL_INT16", "ACL_INT32",
    "ACL_INT64", "ACL_INT8", "ACL_UINT16", "ACL_UINT32", "ACL_UINT64", "ACL_UINT8", "DeviceBuffer",
    "aclCreateIntArray", "aclCreateTensor", "aclDestroyAclOpExecutor", "aclDestroyIntArray", "aclDestroyTensor",
    "aclFinalize", "aclGetDataType", "aclGetFormat", "aclGetRecentErrMsg", "aclGetViewOffset", "aclGetViewShape",
    "aclGetViewStrides", "aclInit", "aclIntArray", "aclOpExecutor", "aclSetAclOpExecutorRepeatable", "aclTensor",
    "aclnnInplacePartialRotaryMul", "aclnnInplacePartialRotaryMulGetWorkspaceSize", "aclnnInplacePartialRotaryMulGrad",
    "aclnnInplacePartialRotaryMulGradGetWorkspaceSize", "aclnnMoeTokenPermute", "aclnnMoeTokenPermuteGetWorkspaceSize",
    "aclnnMoeTokenPermuteGrad", "aclnnMoeTokenPermuteGradGetWorkspaceSize", "aclnnMoeTokenUnpermute",
    "aclnnMoeTokenUnpermuteGetWorkspaceSize", "aclnnMoeTokenUnpermuteGrad", "aclnnMoeTokenUnpermuteGradGetWorkspaceSize",
    "aclnnSparseFlashAttention", "aclnnSparseFlashAttentionGetWorkspaceSize", "aclnnSparseFlashAttentionGrad",
    "aclnnSparseFlashAttentionGradGetWorkspaceSize", "aclnnSparseFlashAttentionV2",
    "aclnnSparseFlashAttentionV2GetWorkspaceSize", "aclrtCreateStream", "aclrtDestroyStream", "aclrtFree",
    "aclrtGetSocName", "aclrtMalloc", "aclrtResetDevice", "aclrtSetDevice", "aclrtStream", "aclrtSynchronizeStream",
    "status_name",
]
