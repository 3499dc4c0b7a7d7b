"""aclnnMoeTokenPermute(Grad): CANN's op_api UT tables (ASCEND950) row for row, its examples step for step, a
plain NumPy reference of the dispatch, strided views, and the ordering of CANN's checks.

Sources (ops-transformer @ 5778144076def6311557939ab5cbfe8303f13e8f): moe/moe_token_permute{,_grad}/docs,
op_host/op_api/aclnn_moe_token_permute{,_grad}.cpp, examples/, tests/ut/op_host/op_api/.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from geir import aclnn
from aclnn.helpers import failure, two_phase
from oracles.moe_permute import permute_reference

PERMUTE = (aclnn.aclnnMoeTokenPermuteGetWorkspaceSize, aclnn.aclnnMoeTokenPermute)
GRAD = (aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize, aclnn.aclnnMoeTokenPermuteGrad)
F16, F32, BF16, I32, I64, I8, I16 = np.float16, np.float32, ml_dtypes.bfloat16, np.int32, np.int64, np.int8, np.int16


def _tensor(shape, dtype, ids=False):
    if shape is None:
        return None
    array = (np.arange(int(np.prod(shape))) % 4).astype(dtype).reshape(shape) if ids else np.zeros(shape, dtype)
    return aclnn.aclCreateTensor(array)


# CANN's success rows with num_out_tokens 4 pass sortedIndicesOut {4}; the doc and the op give one index per slot,
# (tokens * topK,) = (6,): geir's rows use {6} (the mocked UT never checks the output's shape).
PERMUTE_UT = [
    # name, tokens, indices, permuteTokensOut, sortedIndicesOut, numOutTokens, paddedMode, status
    ("fp16_int32", ((2, 5), F16), ((2, 3), I32), ((6, 5), F16), ((6,), I32), 6, False, 0),
    ("fp32_int32", ((2, 5), F32), ((2, 3), I32), ((6, 5), F32), ((6,), I32), 6, False, 0),
    ("bf16_int32", ((2, 5), BF16), ((2, 3), I32), ((6, 5), BF16), ((6,), I32), 6, False, 0),
    ("fp16_int64", ((2, 5), F16), ((2, 3), I64), ((6, 5), F16), ((6,), I32), 6, False, 0),
    ("tokens_nullptr", None, ((2, 3), I32), ((6, 5), F16), ((6,), I32), 6, False, 161001),
    ("indices_nullptr", ((2, 5), F16), None, ((6, 5), F16), ((6,), I32), 6, False, 161001),
    ("permute_tokens_out_nullptr", ((2, 5), F16), ((2, 3), I32), None, ((6,), I32), 6, False, 161001),
    ("sorted_indices_out_nullptr", ((2, 5), F16), ((2, 3), I32), ((6, 5), F16), None, 6, False, 161001),
    ("padded_mode_invalid", ((2, 5), F16), ((2, 3), I32), ((6, 5), F16), ((6,), I32), 6, True, 161002),
    ("indices_1d", ((6, 5), F16), ((6,), I32), ((6, 5), F16), ((6,), I32), 6, False, 0),
    ("num_out_tokens_diff", ((2, 5), F16), ((2, 3), I32), ((4, 5), F16), ((6,), I32), 4, False, 0),
    ("int8_int32", ((2, 5), I8), ((2, 3), I32), ((6, 5), I8), ((6,), I32), 6, False, 0),
    ("int8_int64_1d_slice", ((6, 5), I8), ((6,), I64), ((4, 5), I8), ((6,), I32), 4, False, 0),
    ("int8_output_dtype_invalid", ((2, 5), I8), ((2, 3), I32), ((6, 5), F16), ((6,), I32), 6, False, 161002),
    ("indices_dtype_invalid", ((2, 5), F16), ((2, 3), I16), ((6, 5), F16), ((6,), I32), 6, False, 161002),
    ("sorted_indices_dtype_invalid", ((2, 5), F16), ((2, 3), I32), ((6, 5), F16), ((6,), I64), 6, False, 161002),
    ("permute_tokens_dtype_diff", ((2, 5), F16), ((2, 3), I32), ((6, 5), F32), ((6,), I32), 6, False, 161002),
]


@pytest.mark.parametrize("name, tokens, indices, out, sorted_out, num_out, padded, status", PERMUTE_UT,
                         ids=[r[0] for r in PERMUTE_UT])
def test_moe_token_permute_ut(runtime, on_device, name, tokens, indices, out, sorted_out, num_out, padded, status):
    on_device("ascend950")
    make = lambda spec, ids=False: None if spec is None else _tensor(*spec, ids=ids)  # noqa: E731
    got, size, executor = PERMUTE[0](make(tokens), make(indices, True), num_out, padded, make(out),
                                     make(sorted_out))
    assert got == status, aclnn.aclGetRecentErrMsg()
    if status:
        assert executor is None
        failure(status)
    else:     # the _execute row: phase two runs
        assert PERMUTE[1](aclnn.aclrtMalloc(size), size, executor, None) == 0


PERMUTE_GRAD_UT = [
    # name, permutedOutputGrad, sortedIndices, out, paddedMode, status   (numTopk 3, grad {6,5}, out {2,5})
    ("fp16", F16, I32, F16, False, 0),
    ("fp32", F32, I32, F32, False, 0),
    ("bf16", BF16, I32, BF16, False, 0),
    ("permuted_output_grad_nullptr", None, I32, F16, False, 161001),
    ("sorted_indices_nullptr", F16, None, F16, False, 161001),
    ("out_nullptr", F16, I32, None, False, 161001),
    ("padded_mode_invalid", F16, I32, F16, True, 161002),
    ("permuted_output_grad_dtype_invalid", I8, I32, I8, False, 161002),
    ("sorted_indices_dtype_invalid", F16, I64, F16, False, 161002),
    ("out_dtype_invalid", F16, I32, I8, False, 161002),
    ("dtype_diff", F16, I32, F32, False, 161002),
]


@pytest.mark.parametrize("name, grad, indices, out, padded, status", PERMUTE_GRAD_UT,
                         ids=[r[0] for r in PERMUTE_GRAD_UT])
def test_moe_token_permute_grad_ut(runtime, on_device, name, grad, indices, out, padded, status):
    on_device("ascend950")
    indices_tensor = None if indices is None else aclnn.aclCreateTensor(np.random.default_rng(0).permutation(6)
                                                                        .astype(indices))
    got, size, executor = GRAD[0](None if grad is None else _tensor((6, 5), grad), indices_tensor, 3, padded,
                                  None if out is None else _tensor((2, 5), out))
    assert got == status, aclnn.aclGetRecentErrMsg()
    if status:
        failure(status)
    else:
        assert GRAD[1](aclnn.aclrtMalloc(size), size, executor, None) == 0


def test_the_grad_checks_padded_mode_before_nulls_on_ascend950_and_the_permute_after(runtime, on_device):
    """op_api order: the grad's CHECK_RET(paddedMode == false) comes first; the permute's CheckNotNull first."""
    on_device("ascend950")
    assert GRAD[0](None, None, 3, True, None)[0] == 161002
    assert PERMUTE[0](None, None, 0, True, None, None)[0] == 161001


@pytest.mark.parametrize("num_out", [0, 4, -2, 100])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_the_dispatch_equals_the_reference_through_strided_inputs(runtime, num_out, dtype):
    rng = np.random.default_rng(num_out + 7)
    tokens = rng.standard_normal((4, 3)).astype(dtype)
    indices = rng.integers(0, 3, (4, 2)).astype(np.int64)
    want_rows, want_sorted = permute_reference(tokens, indices, num_out)
    storage = np.zeros((8, 3), dtype)
    storage[::2] = tokens
    strided = aclnn.aclCreateTensor(storage, shape=[4, 3], strides=[6, 1])
    out, sorted_out = np.zeros((len(want_rows), 3), dtype), np.zeros(8, np.int32)
    assert two_phase(*PERMUTE, strided, aclnn.aclCreateTensor(indices), num_out, False, aclnn.aclCreateTensor(out),
                     aclnn.aclCreateTensor(sorted_out)) == 0, aclnn.aclGetRecentErrMsg()
    assert np.array_equal(out, want_rows) and np.array_equal(sorted_out, want_sorted)


def test_the_grad_sums_each_tokens_rows_into_a_strided_out(runtime):
    rng = np.random.default_rng(8)
    indices = rng.integers(0, 4, (3, 2))
    _, sorted_indices = permute_reference(np.zeros((3, 1)), indices)
    grad = rng.standard_normal((6, 4)).astype(np.float32)
    want = grad[sorted_indices].reshape(3, 2, 4).astype(np.float64).sum(1)
    storage = np.full((3, 8), 5.0, np.float32)
    out = aclnn.aclCreateTensor(storage, shape=[3, 4], strides=[8, 1])
    assert two_phase(*GRAD, aclnn.aclCreateTensor(grad), aclnn.aclCreateTensor(sorted_indices), 2, False, out) == 0
    np.testing.assert_allclose(storage[:, :4], want, rtol=1e-6)
    assert np.all(storage[:, 4:] == 5.0)


def test_cann_examples(runtime, on_device):
    """examples/test_aclnn_moe_token_permute.cpp (tokens {3,4} f32, indices {3,2}, numOutTokens 0) and
    examples/test_aclnn_moe_token_permute_grad.cpp (grad {2,2} bf16, sortedIndices {2}, numTopk 2, out {1,2})."""
    on_device("ascend910b")
    stream = aclnn.aclrtCreateStream()
    rng = np.random.default_rng(9)
    tokens = rng.standard_normal((3, 4)).astype(np.float32)
    indices = rng.integers(0, 4, (3, 2)).astype(np.int32)
    out, sorted_out = np.zeros((6, 4), np.float32), np.zeros(6, np.int32)
    status, size, executor = PERMUTE[0](aclnn.aclCreateTensor(tokens), aclnn.aclCreateTensor(indices), 0, False,
                                        aclnn.aclCreateTensor(out), aclnn.aclCreateTensor(sorted_out))
    assert status == 0, aclnn.aclGetRecentErrMsg()
    assert PERMUTE[1](aclnn.aclrtMalloc(size), size, executor, stream) == 0
    assert aclnn.aclrtSynchronizeStream(stream) == 0
    want_rows, want_sorted = permute_reference(tokens, indices)
    assert np.array_equal(out, want_rows) and np.array_equal(sorted_out, want_sorted)

    grad = rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16)
    grad_out = np.zeros((1, 2), ml_dtypes.bfloat16)
    status, size, executor = GRAD[0](aclnn.aclCreateTensor(grad), aclnn.aclCreateTensor(np.array([1, 0], np.int32)),
                                     2, False, aclnn.aclCreateTensor(grad_out))
    assert status == 0, aclnn.aclGetRecentErrMsg()
    assert GRAD[1](aclnn.aclrtMalloc(size), size, executor, stream) == 0
    want = (grad.astype(np.float32)[1] + grad.astype(np.float32)[0]).astype(ml_dtypes.bfloat16)
    assert np.array_equal(grad_out[0], want)


def test_expert_ids_out_of_range_are_found_at_phase_two(runtime):
    tokens = np.ones((2, 3), np.float32)
    indices = np.array([[0, 1], [2, 2**24]], np.int32)
    out, sorted_out = np.full((4, 3), 9.0, np.float32), np.zeros(4, np.int32)
    status, size, executor = PERMUTE[0](aclnn.aclCreateTensor(tokens), aclnn.aclCreateTensor(indices), 0, False,
                                        aclnn.aclCreateTensor(out), aclnn.aclCreateTensor(sorted_out))
    assert status == 0
    assert PERMUTE[1](aclnn.aclrtMalloc(size), size, executor, None) == 361001
    failure(361001, "indices")
    assert np.all(out == 9.0)
