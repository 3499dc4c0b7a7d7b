"""CANN's aclnn op_api UT tables for these ops, row for row, on both runtimes.

Sources (ops-transformer @ 5778144076def6311557939ab5cbfe8303f13e8f): moe/moe_token_unpermute{,_grad}/tests/ut/
op_host/op_api/test_aclnn_moe_token_unpermute{,_grad}.cpp (SoC ASCEND950), attention/sparse_flash_attention/tests/
ut/op_api/test_aclnn_sparse_flash_attention.cpp and attention/sparse_flash_attention_grad/tests/ut/op_api/
test_aclnn_sparse_flash_attention_grad.cpp (SoC ASCEND910B). CANN's UTs run phase one against mocked kernels and
tiling; where a row's shapes break a rule the real tiling (and geir) enforces, the row keeps CANN's failure cases
as they are and names the shape geir needs instead (``fixed``), with the rule that refuses CANN's.
"""

from __future__ import annotations

import numpy as np
import pytest

from geir import aclnn
from aclnn.helpers import failure

F16, F32, BF16, I32, I64, I8 = np.float16, np.float32, "bfloat16", np.int32, np.int64, np.int8


def _tensor(shape, dtype):
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if dtype == BF16 else dtype
    return aclnn.aclCreateTensor(np.zeros(shape, dt) if dt not in (I32, I64) else
                                 np.arange(int(np.prod(shape)), dtype=dt).reshape(shape))


# -- MoeTokenUnpermute (ASCEND950). CANN's success rows pass 6 rows, no probs and out {2, 5}: without probs there
#    is one slot per token, so out is (6, 5) (MU-S1/MU-S2; spec 3.6); with_probs_fp16 passes 1-D probs {6}, which
#    MU-S1 refuses (spec 3.6: "not a valid IR shape") -- geir's row uses probs (3, 2) and out (3, 5).
UNPERMUTE = [
    # name, permutedTokens, sortedIndices, probs, out, paddedMode, status
    ("fp16", ((6, 5), F16), ((6,), I32), None, ((6, 5), F16), False, 0),
    ("fp32", ((6, 5), F32), ((6,), I32), None, ((6, 5), F32), False, 0),
    ("bf16", ((6, 5), BF16), ((6,), I32), None, ((6, 5), BF16), False, 0),
    ("with_probs_fp16", ((6, 5), F16), ((6,), I32), ((3, 2), F16), ((3, 5), F16), False, 0),
    ("with_probs_fp16 as CANN passes it", ((6, 5), F16), ((6,), I32), ((6,), F16), ((2, 5), F16), False, 561002),
    ("permuted_tokens_nullptr", None, ((6,), I32), None, ((6, 5), F16), False, 161001),
    ("sorted_indices_nullptr", ((6, 5), F16), None, None, ((6, 5), F16), False, 161001),
    ("out_nullptr", ((6, 5), F16), ((6,), I32), None, None, False, 161001),
    ("padded_mode_invalid", ((6, 5), F16), ((6,), I32), None, ((6, 5), F16), True, 161002),
    ("permuted_tokens_dtype_invalid", ((6, 5), I8), ((6,), I32), None, ((6, 5), I8), False, 161002),
    ("sorted_indices_dtype_invalid", ((6, 5), F16), ((6,), I64), None, ((6, 5), F16), False, 161002),
    ("probs_dtype_invalid", ((6, 5), F16), ((6,), I32), ((6,), I32), ((6, 5), F16), False, 161002),
    ("out_dtype_invalid", ((6, 5), F16), ((6,), I32), None, ((6, 5), I8), False, 161002),
    ("dtype_diff", ((6, 5), F16), ((6,), I32), None, ((6, 5), F32), False, 161002),
]


@pytest.mark.parametrize("name, tokens, indices, probs, out, padded, status", UNPERMUTE, ids=[r[0] for r in UNPERMUTE])
def test_moe_token_unpermute_ut(runtime, on_device, name, tokens, indices, probs, out, padded, status):
    on_device("ascend950")
    make = lambda spec: None if spec is None else _tensor(*spec)  # noqa: E731
    got, size, executor = aclnn.aclnnMoeTokenUnpermuteGetWorkspaceSize(
        make(tokens), make(indices), make(probs), padded, aclnn.aclCreateIntArray([2, 5]), make(out))
    assert got == status, aclnn.aclGetRecentErrMsg()
    if status:
        assert executor is None
        failure(status)
    else:      # the _execute row: phase two after phase one
        assert aclnn.aclnnMoeTokenUnpermute(aclnn.aclrtMalloc(size), size, executor, None) == 0


# -- MoeTokenUnpermuteGrad (ASCEND950). CANN's rows pass unpermutedTokensGrad {2, 5} with 6 slots and no probs
#    (MG-S2: tokens * topK must be 6; spec 3.6) and probsGradOut {6}: geir's success rows use a grad (6, 5); the
#    probsGradOut without probs is null-checked and never written, so its {6} stays.
GRAD_OK = (((6, 5), F16), ((6, 5), F16), ((6,), I32))
UNPERMUTE_GRAD = [
    # name, permuteTokens, unpermutedTokensGrad, sortedIndices, probs, permutedTokensGradOut, probsGradOut, padded
    ("fp16", ((6, 5), F16), ((6, 5), F16), ((6,), I32), None, ((6, 5), F16), ((6,), F16), False, 0),
    ("fp32", ((6, 5), F32), ((6, 5), F32), ((6,), I32), None, ((6, 5), F32), ((6,), F32), False, 0),
    ("bf16", ((6, 5), BF16), ((6, 5), BF16), ((6,), I32), None, ((6, 5), BF16), ((6,), BF16), False, 0),
    ("with_probs_fp16", ((6, 5), F16), ((3, 5), F16), ((6,), I32), ((3, 2), F16), ((6, 5), F16), ((3, 2), F16),
     False, 0),
    ("as CANN passes its shapes", ((6, 5), F16), ((2, 5), F16), ((6,), I32), None, ((6, 5), F16), ((6,), F16),
     False, 561002),
    ("permute_tokens_nullptr", None, ((6, 5), F16), ((6,), I32), None, ((6, 5), F16), ((6,), F16), False, 161001),
    ("unpermuted_tokens_grad_nullptr", ((6, 5), F16), None, ((6,), I32), None, ((6, 5), F16), ((6,), F16), False,
     161001),
    ("sorted_indices_nullptr", ((6, 5), F16), ((6, 5), F16), None, None, ((6, 5), F16), ((6,), F16), False, 161001),
    ("permuted_tokens_grad_out_nullptr", ((6, 5), F16), ((6, 5), F16), ((6,), I32), None, None, ((6,), F16), False,
     161001),
    ("probs_grad_out_nullptr", ((6, 5), F16), ((6, 5), F16), ((6,), I32), None, ((6, 5), F16), None, False, 161001),
    ("padded_mode_invalid", ((6, 5), F16), ((6, 5), F16), ((6,), I32), None, ((6, 5), F16), ((6,), F16), True,
     161002),
    ("permute_tokens_dtype_invalid", ((6, 5), I8), ((6, 5), I8), ((6,), I32), None, ((6, 5), I8), ((6,), I8), False,
     161002),
    ("sorted_indices_dtype_invalid", ((6, 5), F16), ((6, 5), F16), ((6,), I64), None, ((6, 5), F16), ((6,), F16),
     False, 161002),
    ("probs_optional_dtype_invalid", ((6, 5), F16), ((3, 5), F16), ((6,), I32), ((6,), I32), ((6, 5), F16),
     ((6,), F16), False, 161002),
    ("permuted_tokens_grad_out_dtype_invalid", ((6, 5), F16), ((6, 5), F16), ((6,), I32), None, ((6, 5), I8),
     ((6,), F16), False, 161002),
    ("probs_grad_out_dtype_invalid", ((6, 5), F16), ((6, 5), F16), ((6,), I32), None, ((6, 5), F16), ((6,), I8),
     False, 161002),
    ("dtype_diff", ((6, 5), F32), ((6, 5), F16), ((6,), I32), None, ((6, 5), F16), ((6,), F16), False, 161002),
]


@pytest.mark.parametrize("name, tokens, grad, indices, probs, ptg, pg, padded, status", UNPERMUTE_GRAD,
                         ids=[r[0] for r in UNPERMUTE_GRAD])
def test_moe_token_unpermute_grad_ut(runtime, on_device, name, tokens, grad, indices, probs, ptg, pg, padded, status):
    on_device("ascend950")
    make = lambda spec: None if spec is None else _tensor(*spec)  # noqa: E731
    got, size, executor = aclnn.aclnnMoeTokenUnpermuteGradGetWorkspaceSize(
        make(tokens), make(grad), make(indices), make(probs), padded, aclnn.aclCreateIntArray([2, 5]), make(ptg),
        make(pg))
    assert got == status, aclnn.aclGetRecentErrMsg()
    if status:
        assert executor is None
        failure(status)
    else:
        assert aclnn.aclnnMoeTokenUnpermuteGrad(aclnn.aclrtMalloc(size), size, executor, None) == 0


# -- SparseFlashAttention V1/V2 (ASCEND910B): q {2,1,32,64}, k = v {2,128,1,64}, indices {2,1,1,2}, block 64.
def _sfa_call(v2=False, key=True, value=True, sinks=False, lse=False):
    q, k = _tensor((2, 1, 32, 64), F16), _tensor((2, 128, 1, 64), F16)
    idx = aclnn.aclCreateTensor(np.zeros((2, 1, 1, 2), np.int32))
    head = (q, k if key else None, _tensor((2, 128, 1, 64), F16) if value else None, idx, None, None, None, None,
            None)
    tail = (0.0416666666666667, 64, "BSND", "BSND", 3, 2**63 - 1, 2**63 - 1, 0, lse,
            _tensor((2, 1, 32, 64), F16), None, None)
    if v2:
        sinks_tensor = aclnn.aclCreateTensor(np.zeros(1, np.float32)) if sinks else None
        return aclnn.aclnnSparseFlashAttentionV2GetWorkspaceSize(*head, sinks_tensor, *tail)
    return aclnn.aclnnSparseFlashAttentionGetWorkspaceSize(*head, *tail)


@pytest.mark.parametrize("name, kwargs, check", [
    ("aclnn_0 missing lse outputs", dict(lse=True), lambda s: s == 161001),
    ("aclnn_1 holder fallback (key null)", dict(key=False), lambda s: s == 161001),
    ("v2 a3_sinks_not_supported", dict(v2=True, sinks=True), lambda s: s == 361001),
    ("v2 a3_without_sinks_not_blocked", dict(v2=True, lse=True), lambda s: s not in (0, 361001)),
])
def test_sparse_flash_attention_ut(runtime, on_device, name, kwargs, check):
    """CANN expects "not success" (executor null) for aclnn_0/aclnn_1, exactly 361001 for the A3 sinks row and
    anything but 361001 for the row without sinks."""
    on_device("ascend910b")
    status, size, executor = _sfa_call(**kwargs)
    assert check(status) and executor is None, (status, aclnn.aclGetRecentErrMsg())


# -- SparseFlashAttentionGrad (ASCEND910B): q {1,64,8,128}, k {1,128,1,128}, indices {1,64,1,4}, block 64. CANN
#    passes stats {1,8,64}; SG-S10 needs (B, N2, S1, G) = (1,1,64,8). On Atlas A2 the grad's D = 512 and K limits
#    are the docs' only (level unsupported: the device code accepts them), so the rows run there as in CANN;
#    ascend950's code refuses them (561002).
def _grad_call(value=True, query=True, stats=(1, 1, 64, 8)):
    q = _tensor((1, 64, 8, 128), F16)
    k = _tensor((1, 128, 1, 128), F16)
    idx = aclnn.aclCreateTensor(np.tile(np.arange(4, dtype=np.int32), (1, 64, 1, 1)))
    return aclnn.aclnnSparseFlashAttentionGradGetWorkspaceSize(
        q if query else None, k, _tensor((1, 128, 1, 128), F16) if value else None, idx, _tensor((1, 64, 8, 128), F16),
        _tensor((1, 64, 8, 128), F16), _tensor(stats, F32), _tensor(stats, F32), None, None, None, None, 0.0883883476,
        64, "BSND", 3, 2**63 - 1, 2**63 - 1, False, _tensor((1, 64, 8, 128), F16), _tensor((1, 128, 1, 128), F16),
        _tensor((1, 128, 1, 128), F16) if value else None, None, None)


@pytest.mark.parametrize("name, kwargs, status", [
    ("A1_bsnd_fp16_value_present", dict(), 0),
    ("A2_bsnd_fp16_value_optional_null", dict(value=False), 0),
    ("E1_null_query", dict(query=False), 161001),
    ("A1 with CANN's stats {1,8,64}", dict(stats=(1, 8, 64)), 561002),
])
def test_sparse_flash_attention_grad_ut(runtime, on_device, name, kwargs, status):
    on_device("ascend910b")
    got, size, executor = _grad_call(**kwargs)
    assert got == status, aclnn.aclGetRecentErrMsg()
    assert (executor is None) == (status != 0)


def test_sparse_flash_attention_grad_ut_on_ascend950_hits_its_tiling_rules(runtime, on_device):
    on_device("ascend950")
    assert _grad_call()[0] == 561002
    failure(561002, "ascend950")
