"""The aclnn machinery every API shares: tensor views over caller memory, executors (single use, repeatable,
destroyed), the workspace contract, streams, the error channel, and aclInit's choices."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import geir
from geir import aclnn
from aclnn.helpers import failure

MOE = (aclnn.aclnnMoeTokenUnpermuteGetWorkspaceSize, aclnn.aclnnMoeTokenUnpermute)


def _moe_phase_one(out=None):
    rng = np.random.default_rng(0)
    permuted = rng.standard_normal((6, 4)).astype(np.float32)
    indices = rng.permutation(6).astype(np.int32)
    probs = rng.random((3, 2)).astype(np.float32)
    out = np.zeros((3, 4), np.float32) if out is None else out
    status, size, executor = MOE[0](aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(indices),
                                    aclnn.aclCreateTensor(probs), False, None, aclnn.aclCreateTensor(out))
    assert status == 0 and executor is not None
    return size, executor, out, (permuted, indices, probs)


def test_the_workspace_is_what_the_native_kernel_would_allocate_and_a_smaller_one_is_refused(runtime):
    size, executor, out, _ = _moe_phase_one()
    assert size == 2 * (8 + 4) + (2 * 4 + 1) * 4          # a row pointer and a weight per slot, two float32 rows
    assert MOE[1](aclnn.aclrtMalloc(size - 1), size - 1, executor, None) == 161002
    failure(161002, "workspaceSize", f"at least {size}")
    assert MOE[1](None, size, executor, None) == 161001
    failure(161001, "workspace")
    small = aclnn.aclrtMalloc(size - 1)
    assert MOE[1](small, size, executor, None) == 161002
    failure(161002, "holds")
    assert np.all(out == 0)                               # no refused launch ran
    assert MOE[1](aclnn.aclrtMalloc(size), size, executor, None) == 0 and np.any(out != 0)


def test_an_executor_runs_once_unless_made_repeatable(runtime):
    size, executor, out, _ = _moe_phase_one()
    assert MOE[1](aclnn.aclrtMalloc(size), size, executor, None) == 0
    assert MOE[1](aclnn.aclrtMalloc(size), size, executor, None) == 161002
    failure(161002, "single-use", "aclSetAclOpExecutorRepeatable")

    size, executor, out, (permuted, indices, probs) = _moe_phase_one()
    assert aclnn.aclSetAclOpExecutorRepeatable(executor) == 0
    workspace = aclnn.aclrtMalloc(size)
    assert MOE[1](workspace, size, executor, None) == 0
    first = out.copy()
    permuted *= 2                                         # a repeated run reads the tensors' memory again
    assert MOE[1](workspace, size, executor, None) == 0
    np.testing.assert_array_equal(out, first * 2)
    assert aclnn.aclDestroyAclOpExecutor(executor) == 0
    assert MOE[1](workspace, size, executor, None) == 161002
    failure(161002, "executor")


def test_repeatable_must_be_set_before_the_first_run(runtime):
    size, executor, _, _ = _moe_phase_one()
    assert MOE[1](aclnn.aclrtMalloc(size), size, executor, None) == 0
    assert aclnn.aclSetAclOpExecutorRepeatable(executor) == 161002
    assert aclnn.aclSetAclOpExecutorRepeatable(None) == 161001


def test_streams_count_their_launches_and_a_destroyed_one_is_refused(runtime):
    size, executor, _, _ = _moe_phase_one()
    stream = aclnn.aclrtCreateStream()
    assert MOE[1](aclnn.aclrtMalloc(size), size, executor, stream) == 0
    assert stream.launched == 1 and aclnn.aclrtSynchronizeStream(stream) == 0
    assert aclnn.aclrtDestroyStream(stream) == 0
    size, executor, _, _ = _moe_phase_one()
    assert MOE[1](aclnn.aclrtMalloc(size), size, executor, stream) == 161002
    failure(161002, "stream")
    assert aclnn.aclrtSynchronizeStream(stream) == 161002


def test_a_tensor_destroyed_between_the_phases_is_refused(runtime):
    rng = np.random.default_rng(1)
    permuted = aclnn.aclCreateTensor(rng.standard_normal((2, 4)).astype(np.float32))
    status, size, executor = MOE[0](permuted, aclnn.aclCreateTensor(np.array([1, 0], np.int32)), None, False, None,
                                    aclnn.aclCreateTensor(np.zeros((2, 4), np.float32)))
    assert status == 0
    aclnn.aclDestroyTensor(permuted)
    assert MOE[1](aclnn.aclrtMalloc(size), size, executor, None) == 161002
    failure(161002, "destroyed")


def test_the_error_message_is_per_thread_and_cleared_by_reading(runtime):
    assert aclnn.aclGetRecentErrMsg() is None
    assert MOE[0](None, None, None, False, None, None)[0] == 161001
    seen = []
    worker = threading.Thread(target=lambda: seen.append(aclnn.aclGetRecentErrMsg()))
    worker.start(), worker.join()
    assert seen == [None]
    message = aclnn.aclGetRecentErrMsg()
    assert message is not None and "aclnnMoeTokenUnpermuteGetWorkspaceSize" in message
    assert aclnn.aclGetRecentErrMsg() is None
    assert aclnn.status_name(161001) == "ACLNN_ERR_PARAM_NULLPTR"


def test_views_describe_caller_memory_and_bad_views_are_refused():
    storage = np.arange(24, dtype=np.float32)
    view = aclnn.aclCreateTensor(storage, shape=[2, 3], strides=[12, 2], offset=1)
    assert aclnn.aclGetViewShape(view) == (0, [2, 3]) and aclnn.aclGetViewStrides(view) == (0, [12, 2])
    assert aclnn.aclGetViewOffset(view) == (0, 1) and aclnn.aclGetDataType(view) == (0, aclnn.ACL_FLOAT)
    np.testing.assert_array_equal(view.read(), [[1, 3, 5], [13, 15, 17]])
    assert not view.is_contiguous()
    with pytest.raises(geir.GraphError, match="reaches element 24, past the storage's 24"):
        aclnn.aclCreateTensor(storage, shape=[2, 3], strides=[12, 2], offset=8)
    with pytest.raises(geir.GraphError, match="strides: expected 2 values"):
        aclnn.aclCreateTensor(storage, shape=[2, 3], strides=[1])
    with pytest.raises(geir.GraphError, match="size >= 0 and stride >= 0"):
        aclnn.aclCreateTensor(storage, shape=[2, 3], strides=[-1, 1])
    with pytest.raises(geir.GraphError, match="C-contiguous"):
        aclnn.aclCreateTensor(storage.reshape(4, 6)[:, ::2], shape=[2])
    with pytest.raises(geir.GraphError, match="numpy.ndarray or a CPU torch.Tensor"):
        aclnn.aclCreateTensor([1.0, 2.0])
    with pytest.raises(geir.GraphError, match="int64"):
        aclnn.aclCreateIntArray([2**63])
    transposed = aclnn.aclCreateTensor(storage.reshape(4, 6).T)        # a NumPy view keeps its own strides
    assert transposed.strides == (1, 6) and not transposed.is_contiguous()


def test_a_torch_tensor_is_viewed_not_copied(runtime):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    dy = torch.from_numpy(np.tile(np.arange(1, 9, dtype=np.float32), (1, 1, 1, 1))).to(torch.bfloat16)
    table = torch.from_numpy(rng.random((1, 1, 1, 8)).astype(np.float32)).to(torch.bfloat16)
    before = dy.clone()
    status, size, executor = aclnn.aclnnInplacePartialRotaryMulGradGetWorkspaceSize(
        aclnn.aclCreateTensor(dy), aclnn.aclCreateTensor(table), aclnn.aclCreateTensor(table), 1, None)
    assert status == 0
    assert aclnn.aclnnInplacePartialRotaryMulGrad(None, size, executor, None) == 0
    assert not torch.equal(dy, before)          # written through the tensor's own memory


def test_aclinit_validates_its_choices():
    with pytest.raises(geir.GraphError, match="unknown target 'ascend310b'"):
        aclnn.aclInit(None, target="ascend310b")
    with pytest.raises(geir.GraphError, match="runtime: expected one of"):
        aclnn.aclInit(None, runtime="cuda")
    assert aclnn.aclInit(None, target="ascend950") == 0 and aclnn.aclrtGetSocName() == "ascend950"
    assert aclnn.aclFinalize() == 0 and aclnn.aclrtGetSocName() is None


def test_the_same_results_on_both_runtimes():
    outs = []
    for name in ("numpy", "onnxruntime"):
        aclnn.aclInit(None, runtime=name)
        size, executor, out, _ = _moe_phase_one()
        assert MOE[1](aclnn.aclrtMalloc(size), size, executor, None) == 0
        outs.append(out)
    aclnn.aclFinalize()
    assert np.array_equal(outs[0], outs[1])


def test_a_view_numpy_cannot_address_is_a_graph_error():
    """A size-1 dim may carry any stride, but not one past what NumPy can address (review of issue 27)."""
    with pytest.raises(geir.GraphError, match="cannot be addressed"):
        aclnn.aclCreateTensor(np.zeros(4, np.float32), shape=[1, 4], strides=[2**62, 1])
    assert aclnn.aclSetAclOpExecutorRepeatable(None) == 161001
    failure(161001, "executor")
