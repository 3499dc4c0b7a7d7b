"""CANN's ``examples/test_aclnn_*.cpp`` for these ops, step for step: aclInit, a stream, aclCreateTensor per
operand (random data where CANN fills constants), phase one, aclrtMalloc of the workspace, phase two,
aclrtSynchronizeStream, the result read back, the tensors destroyed; on the device the example targets, on both
runtimes. Each result is held to the float64 oracle.

Sources (ops-transformer @ 5778144076def6311557939ab5cbfe8303f13e8f): posembedding/inplace_partial_rotary_mul/
examples/test_aclnn_inplace_partial_rotary_mul.cpp; posembedding/inplace_partial_rotary_mul_grad/examples/arch35/
test_aclnn_inplace_partial_rotary_mul_grad{,_bab}.cpp; moe/moe_token_unpermute{,_grad}/examples/;
attention/sparse_flash_attention/examples/test_aclnn_sparse_flash_attention{,_v2}.cpp;
attention/sparse_flash_attention_grad/examples/test_aclnn_sparse_flash_attention_grad.cpp.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from geir import aclnn
from oracles.moe import unpermute_grad_reference, unpermute_reference
from oracles.numerics import assert_matches_reference
from oracles.rotary import rotary_reference
from oracles.sfa import forward_reference, grad_reference


@pytest.fixture(params=["numpy", "onnxruntime"])
def device(request):
    """aclInit + aclrtSetDevice(0) + aclrtCreateStream, as each example's Init(); the teardown as its end."""
    def init(target: str):
        assert aclnn.aclInit(None, target=target, runtime=request.param) == 0
        assert aclnn.aclrtSetDevice(0) == 0
        return aclnn.aclrtCreateStream()
    yield init
    aclnn.aclrtResetDevice(0)
    aclnn.aclFinalize()


def _launch(phase_two, size, executor, stream):
    workspace = aclnn.aclrtMalloc(size) if size > 0 else None
    assert phase_two(workspace, size, executor, stream) == 0, aclnn.aclGetRecentErrMsg()
    assert aclnn.aclrtSynchronizeStream(stream) == 0
    if workspace is not None:
        aclnn.aclrtFree(workspace)


@pytest.mark.parametrize("target", ["ascend910b", "ascend910_93", "ascend950"])
def test_inplace_partial_rotary_mul_example(device, target):
    stream = device(target)
    rng = np.random.default_rng(0)
    x = rng.integers(1, 129, (1, 1, 1, 128)).astype(np.float32)
    cos, sin = (rng.integers(1, 129, (1, 1, 1, 128)).astype(np.float32) for _ in range(2))
    want, magnitude = rotary_reference(x, cos, sin, 1, 0, 128, False)
    xt, ct, st = aclnn.aclCreateTensor(x), aclnn.aclCreateTensor(cos), aclnn.aclCreateTensor(sin)
    partial_slice = aclnn.aclCreateIntArray([0, 128])
    status, size, executor = aclnn.aclnnInplacePartialRotaryMulGetWorkspaceSize(xt, ct, st, 1, partial_slice)
    assert status == 0, aclnn.aclGetRecentErrMsg()
    _launch(aclnn.aclnnInplacePartialRotaryMul, size, executor, stream)
    assert_matches_reference(x, want, magnitude, "x")
    aclnn.aclDestroyIntArray(partial_slice)
    for tensor in (xt, ct, st):
        aclnn.aclDestroyTensor(tensor)


@pytest.mark.parametrize("dy_shape, table_shape, bounds", [((1, 1, 1, 128), (1, 1, 1, 128), (0, 128)),
                                                           ((2, 2, 2, 8), (1, 2, 1, 4), (2, 6))])   # the _bab one
def test_inplace_partial_rotary_mul_grad_examples(device, dy_shape, table_shape, bounds):
    stream = device("ascend950")
    rng = np.random.default_rng(1)
    dy = rng.integers(1, 129, dy_shape).astype(np.float32)
    cos, sin = (rng.integers(1, 129, table_shape).astype(np.float32) for _ in range(2))
    want, magnitude = rotary_reference(dy, cos, sin, 1, *bounds, True)
    status, size, executor = aclnn.aclnnInplacePartialRotaryMulGradGetWorkspaceSize(
        aclnn.aclCreateTensor(dy), aclnn.aclCreateTensor(cos), aclnn.aclCreateTensor(sin), 1,
        aclnn.aclCreateIntArray(list(bounds)))
    assert status == 0, aclnn.aclGetRecentErrMsg()
    _launch(aclnn.aclnnInplacePartialRotaryMulGrad, size, executor, stream)
    assert_matches_reference(dy, want, magnitude, "dyRef")


def test_moe_token_unpermute_example(device):
    stream = device("ascend910b")
    rng = np.random.default_rng(2)
    bf16 = ml_dtypes.bfloat16
    permuted = rng.standard_normal((2, 2)).astype(bf16)
    indices = np.array([1, 0], np.int32)
    probs = rng.random((1, 2)).astype(bf16)
    out = np.zeros((1, 2), bf16)
    status, size, executor = aclnn.aclnnMoeTokenUnpermuteGetWorkspaceSize(
        aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(indices), aclnn.aclCreateTensor(probs), False, None,
        aclnn.aclCreateTensor(out))
    assert status == 0, aclnn.aclGetRecentErrMsg()
    _launch(aclnn.aclnnMoeTokenUnpermute, size, executor, stream)
    want, magnitude = unpermute_reference(permuted, indices, probs)
    assert_matches_reference(out, want, magnitude, "out")


def test_moe_token_unpermute_grad_example(device):
    stream = device("ascend910b")
    rng = np.random.default_rng(3)
    permuted = rng.standard_normal((3, 2)).astype(np.float32)
    grad = rng.standard_normal((1, 2)).astype(np.float32)
    probs = rng.random((1, 3)).astype(np.float32)
    indices = np.array([2, 0, 1], np.int32)
    ptg, pg = np.zeros((3, 2), np.float32), np.zeros((1, 3), np.float32)
    status, size, executor = aclnn.aclnnMoeTokenUnpermuteGradGetWorkspaceSize(
        aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(grad), aclnn.aclCreateTensor(indices),
        aclnn.aclCreateTensor(probs), False, None, aclnn.aclCreateTensor(ptg), aclnn.aclCreateTensor(pg))
    assert status == 0, aclnn.aclGetRecentErrMsg()
    _launch(aclnn.aclnnMoeTokenUnpermuteGrad, size, executor, stream)
    want_ptg, ptg_magnitude, want_pg, pg_magnitude = unpermute_grad_reference(permuted, grad, indices, probs)
    assert_matches_reference(ptg, want_ptg, ptg_magnitude, "permutedTokensGradOut")
    assert_matches_reference(pg, want_pg, pg_magnitude, "probsGradOut")


def _sfa_example_tensors(rng):
    """The examples' TND shapes: one query token, 16 heads, 2048 keys, D 512, rope 64, iota block ids."""
    normal = lambda *shape: (rng.standard_normal(shape) * 0.5).astype(np.float16)  # noqa: E731
    return dict(query=normal(1, 16, 512), key=normal(2048, 1, 512), query_rope=normal(1, 16, 64),
                key_rope=normal(2048, 1, 64), sparse_indices=np.arange(2048, dtype=np.int32).reshape(1, 1, 2048),
                aq=np.array([1], np.int32), akv=np.array([2048], np.int32))


@pytest.mark.parametrize("v2", [False, True])
def test_sparse_flash_attention_examples(device, v2):
    """V1 on Atlas A2; V2 (sinks of zeros) only on ascend950, where its example runs."""
    stream = device("ascend950" if v2 else "ascend910b")
    a = _sfa_example_tensors(np.random.default_rng(4))
    t = aclnn.aclCreateTensor
    out = np.zeros((1, 16, 512), np.float16)
    stats = [np.zeros((1, 1, 16), np.float32) for _ in range(2)]
    head = (t(a["query"]), t(a["key"]), t(a["key"]), t(a["sparse_indices"]), None, t(a["aq"]), t(a["akv"]),
            t(a["query_rope"]), t(a["key_rope"]))
    tail = (0.0416666666666667, 1, "TND", "TND", 0, 2**63 - 1, 2**63 - 1, 2, False, t(out), t(stats[0]),
            t(stats[1]))
    if v2:
        sinks = np.zeros(16, np.float32)
        status, size, executor = aclnn.aclnnSparseFlashAttentionV2GetWorkspaceSize(*head, t(sinks), *tail)
        run = aclnn.aclnnSparseFlashAttentionV2
    else:
        status, size, executor = aclnn.aclnnSparseFlashAttentionGetWorkspaceSize(*head, *tail)
        run, sinks = aclnn.aclnnSparseFlashAttention, None
    assert status == 0, aclnn.aclGetRecentErrMsg()
    _launch(run, size, executor, stream)
    assert np.all(stats[0] == 0) and np.all(stats[1] == 0)          # returnSoftmaxLse false: not written
    want = forward_reference(a["query"], a["key"], a["key"], a["sparse_indices"], scale=float(np.float32(0.0416666666666667)),
                             layout="TND", mode=0, aq=a["aq"], akv=a["akv"], query_rope=a["query_rope"],
                             key_rope=a["key_rope"], sinks=sinks, round_to=np.float16)[0]
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=5e-3, atol=2.5e-5 * 64)


def test_sparse_flash_attention_grad_example(device):
    stream = device("ascend910b")
    rng = np.random.default_rng(5)
    a = _sfa_example_tensors(rng)
    t = aclnn.aclCreateTensor
    scale = 0.044194
    forward = forward_reference(a["query"], a["key"], a["key"], a["sparse_indices"], scale=float(np.float32(scale)),
                                layout="TND", mode=0, aq=a["aq"], akv=a["akv"], query_rope=a["query_rope"],
                                key_rope=a["key_rope"], round_to=np.float16)
    out = forward[0].astype(np.float16)
    softmax_max, softmax_sum = (s.astype(np.float32) for s in forward[1:3])
    d_out = (rng.standard_normal((1, 16, 512)) * 0.5).astype(np.float16)
    dq, dq_rope = np.zeros((1, 16, 512), np.float16), np.zeros((1, 16, 64), np.float16)
    dk, dv, dk_rope = np.zeros((2048, 1, 512), np.float16), np.zeros((2048, 1, 512), np.float16), \
        np.zeros((2048, 1, 64), np.float16)
    status, size, executor = aclnn.aclnnSparseFlashAttentionGradGetWorkspaceSize(
        t(a["query"]), t(a["key"]), t(a["key"]), t(a["sparse_indices"]), t(d_out), t(out), t(softmax_max),
        t(softmax_sum), t(a["aq"]), t(a["akv"]), t(a["query_rope"]), t(a["key_rope"]), scale, 1, "TND", 0,
        2147483647, 2147483647, False, t(dq), t(dk), t(dv), t(dq_rope), t(dk_rope))
    assert status == 0, aclnn.aclGetRecentErrMsg()
    _launch(aclnn.aclnnSparseFlashAttentionGrad, size, executor, stream)
    want = grad_reference(a["query"], a["key"], a["sparse_indices"], d_out, out, softmax_max, softmax_sum,
                          scale=float(np.float32(scale)), value=a["key"], layout="TND", mode=0, aq=a["aq"],
                          akv=a["akv"], query_rope=a["query_rope"], key_rope=a["key_rope"], round_to=np.float16)
    for got, ref, name in zip((dq, dk, dv, dq_rope, dk_rope), want, ("dq", "dk", "dv", "dqRope", "dkRope")):
        scale_of = max(float(np.abs(ref).max()), 1e-3)
        np.testing.assert_allclose(got.astype(np.float64), ref, atol=2e-2 * scale_of, rtol=2e-2, err_msg=name)
