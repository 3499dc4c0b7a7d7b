"""aclnnInplacePartialRotaryMul(Grad): CANN's worked example, every mode against the float64 oracle, in-place
writes through the caller's memory, the null-pointer and contiguity statuses, and the device rows."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir import aclnn
from aclnn.helpers import failure, two_phase
from oracles.numerics import assert_matches_reference
from oracles.rotary import rotary_reference

GRAD = (aclnn.aclnnInplacePartialRotaryMulGradGetWorkspaceSize, aclnn.aclnnInplacePartialRotaryMulGrad)
FORWARD = (aclnn.aclnnInplacePartialRotaryMulGetWorkspaceSize, aclnn.aclnnInplacePartialRotaryMul)


def test_cann_example_e1_writes_dy_in_place(runtime):
    """Spec 2.5 E1 (CANN's example): every row [1..8], slice [2, 6], mode 1 -> [1, 2, 2.3, 2.1, 5.9, 3.3, 7, 8]."""
    dy = np.tile(np.arange(1, 9, dtype=np.float32), (2, 2, 2, 1))
    cos = np.tile(np.float32([0.5, 0.6, 0.7, 0.8]), (1, 2, 1, 1))
    sin = np.tile(np.float32([0.1, 0.2, 0.3, 0.4]), (1, 2, 1, 1))
    cos_before, sin_before = cos.copy(), sin.copy()
    status = two_phase(*GRAD, aclnn.aclCreateTensor(dy), aclnn.aclCreateTensor(cos), aclnn.aclCreateTensor(sin), 1,
                       aclnn.aclCreateIntArray([2, 6]))
    assert status == aclnn.ACLNN_SUCCESS
    np.testing.assert_allclose(dy, np.broadcast_to(np.float32([1, 2, 2.3, 2.1, 5.9, 3.3, 7, 8]), dy.shape),
                               rtol=1e-6)
    assert np.array_equal(cos, cos_before) and np.array_equal(sin, sin_before)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype, table_dtype", [("float32", "float32"), ("float16", "float32"),
                                                ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("is_grad", [False, True])
def test_every_mode_matches_the_float64_oracle(runtime, mode, dtype, table_dtype, is_grad):
    rng = np.random.default_rng(mode)
    dt, ct = geir.as_dtype(dtype).numpy, geir.as_dtype(table_dtype).numpy
    x = rng.standard_normal((2, 3, 4, 24)).astype(dt)
    cos, sin = (rng.standard_normal((1, 3, 1, 16)).astype(ct) for _ in range(2))
    want, magnitude = rotary_reference(x, cos, sin, mode, 4, 20, is_grad)
    ref = aclnn.aclCreateTensor(x)
    status = two_phase(*(GRAD if is_grad else FORWARD), ref, aclnn.aclCreateTensor(cos), aclnn.aclCreateTensor(sin),
                       mode, aclnn.aclCreateIntArray([4, 20]))
    assert status == aclnn.ACLNN_SUCCESS
    assert_matches_reference(x, want, magnitude, f"mode {mode}")


def test_null_partial_slice_is_the_whole_last_axis(runtime):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 2, 8)).astype(np.float32)
    cos, sin = rng.standard_normal((2, 1, 1, 1, 8)).astype(np.float32)
    whole, null = x.copy(), x.copy()
    for target, bounds in ((whole, aclnn.aclCreateIntArray([0, 8])), (null, None)):
        assert two_phase(*GRAD, aclnn.aclCreateTensor(target), aclnn.aclCreateTensor(cos),
                         aclnn.aclCreateTensor(sin), 1, bounds) == 0
    assert np.array_equal(whole, null) and not np.array_equal(whole, x)


@pytest.mark.parametrize("missing", ["dyRef", "cos", "sin"])
def test_a_null_required_tensor_is_161001(runtime, missing):
    """Doc: ACLNN_ERR_PARAM_NULLPTR 161001 when dyRef, cos or sin is a null pointer."""
    args = {"dyRef": np.ones((1, 1, 1, 8), np.float32), "cos": np.ones((1, 1, 1, 8), np.float32),
            "sin": np.ones((1, 1, 1, 8), np.float32)}
    tensors = {k: None if k == missing else aclnn.aclCreateTensor(v) for k, v in args.items()}
    assert two_phase(*GRAD, tensors["dyRef"], tensors["cos"], tensors["sin"], 1, None) == 161001
    failure(161001, missing, "null pointer")


def test_data_type_and_format_are_161002_shape_and_mode_561002(runtime):
    """Doc: dtype/format outside the lists 161002; a shape outside the constraints or rotaryMode outside 0..3
    561002 (ACLNN_ERR_INNER_TILING_ERROR)."""
    ones = lambda *shape, dt=np.float32: aclnn.aclCreateTensor(np.ones(shape, dt))  # noqa: E731
    assert two_phase(*GRAD, ones(1, 1, 1, 8, dt=np.float64), ones(1, 1, 1, 8), ones(1, 1, 1, 8), 1, None) == 161002
    failure(161002, "dyRef", "ACL_DOUBLE")
    nchw = aclnn.aclCreateTensor(np.ones((1, 1, 1, 8), np.float32), format=aclnn.ACL_FORMAT_NCHW)
    assert two_phase(*GRAD, nchw, ones(1, 1, 1, 8), ones(1, 1, 1, 8), 1, None) == 161002
    failure(161002, "dyRef", "ACL_FORMAT_NCHW")
    assert two_phase(*GRAD, ones(1, 1, 1, 8), ones(1, 1, 1, 8, dt=np.float16), ones(1, 1, 1, 8), 1, None) == 161002
    failure(161002, "SCH-")
    assert two_phase(*GRAD, ones(1, 1, 1, 8), ones(1, 1, 1, 8), ones(1, 1, 1, 8), 4, None) == 561002
    failure(561002, "RP-S4", "rotary_mode", "got 4")
    assert two_phase(*GRAD, ones(1, 1, 1, 8), ones(1, 1, 1, 6), ones(1, 1, 1, 6), 1, None) == 561002
    failure(561002, "RP-S7")
    assert two_phase(*GRAD, ones(1, 1, 8), ones(1, 1, 8), ones(1, 1, 8), 1, None) == 561002
    failure(561002, "RP-S1", "rank")


def test_strided_tensors_are_refused_and_memory_untouched(runtime):
    """Doc: the non-contiguous column is "×" for dyRef, cos and sin."""
    storage = np.arange(2 * 1 * 1 * 16, dtype=np.float32).reshape(2, 1, 1, 16)
    before = storage.copy()
    strided = aclnn.aclCreateTensor(storage, shape=[2, 1, 1, 8], strides=[16, 16, 16, 1])
    table = aclnn.aclCreateTensor(np.ones((1, 1, 1, 8), np.float32))
    assert two_phase(*GRAD, strided, table, table, 1, None) == 161002
    failure(161002, "dyRef", "contiguous", "strides [16, 16, 16, 1]")
    strided_table = aclnn.aclCreateTensor(np.ones((1, 1, 1, 16), np.float32), shape=[1, 1, 1, 8],
                                          strides=[16, 16, 16, 2])
    assert two_phase(*GRAD, aclnn.aclCreateTensor(storage[:1].copy()), strided_table, table, 1, None) == 161002
    failure(161002, "cos", "contiguous")
    assert np.array_equal(storage, before)


def test_an_offset_view_is_written_in_place_and_nothing_else(runtime):
    """A contiguous view at an offset into a larger buffer: the op writes exactly the view's elements."""
    rng = np.random.default_rng(3)
    storage = rng.standard_normal(3 * 8).astype(np.float32)
    before = storage.copy()
    cos, sin = rng.standard_normal((2, 1, 1, 1, 8)).astype(np.float32)
    view = aclnn.aclCreateTensor(storage, shape=[1, 1, 1, 8], offset=8)
    assert two_phase(*GRAD, view, aclnn.aclCreateTensor(cos), aclnn.aclCreateTensor(sin), 1, None) == 0
    want, _ = rotary_reference(before[8:16].reshape(1, 1, 1, 8), cos, sin, 1, 0, 8, True)
    assert np.array_equal(storage[:8], before[:8]) and np.array_equal(storage[16:], before[16:])
    np.testing.assert_allclose(storage[8:16], want.reshape(-1), rtol=1e-6)


@pytest.mark.parametrize("target, status", [("ascend910b", 361001), ("ascend910_93", 361001), ("ascend950", 0)])
def test_the_grad_runs_only_where_its_kernel_exists(runtime, on_device, target, status):
    """RP-T1: the grad kernel is ascend950's only ("该算子仅支持Ascend 950 AI Processor")."""
    on_device(target)
    table = aclnn.aclCreateTensor(np.ones((1, 1, 1, 8), np.float32))
    assert two_phase(*GRAD, aclnn.aclCreateTensor(np.ones((1, 1, 1, 8), np.float32)), table, table, 1,
                     None) == status
    if status:
        failure(status, "RP-T1", target)


@pytest.mark.parametrize("api, status", [(FORWARD, 161002), (GRAD, 561002)])
def test_mode_0_is_refused_on_ascend950_by_rp_t2(runtime, on_device, api, status):
    """The forward's doc lists rotary_mode != 1 under 161002; the grad's lists its shape and mode refusals under
    561002 (its tiling's)."""
    on_device("ascend950")
    table = aclnn.aclCreateTensor(np.ones((1, 1, 1, 8), np.float32))
    assert two_phase(*api, aclnn.aclCreateTensor(np.ones((1, 1, 1, 8), np.float32)), table, table, 0, None) == status
    failure(status, "RP-T2", "ascend950")


@pytest.mark.parametrize("dy_shape, table_shape", [((2, 0, 2, 8), (1, 0, 1, 8)), ((1, 1, 1, 8), (1, 1, 1, 0)),
                                                   ((0, 1, 1, 8), (1, 1, 1, 8))])
def test_an_empty_grad_input_is_a_no_op(runtime, on_device, dy_shape, table_shape):
    """Grad doc, 空输入支持: an empty dyRef, cos or sin makes the op return at once (status 0, nothing written)."""
    on_device("ascend950")
    dy = np.full(dy_shape, 3.0, np.float32)
    table = aclnn.aclCreateTensor(np.ones(table_shape, np.float32))
    assert two_phase(*GRAD, aclnn.aclCreateTensor(dy), table, table, 1, None) == 0
    assert np.all(dy == 3.0)
    bad = aclnn.aclCreateTensor(np.ones(table_shape[:3], np.float32))
    assert two_phase(*GRAD, aclnn.aclCreateTensor(dy), bad, bad, 1, None) == 561002     # ranks are still checked
    failure(561002, "RP-S1")


def test_an_empty_grad_still_gets_every_other_check(runtime, on_device):
    """Review of issue 27: the empty grad is a no-op only once dtypes, bounds and table widths pass (the arch35
    tiling checks them before its no-op key): int32 cos with float32 sin is refused, as is a slice past D."""
    on_device("ascend950")
    dy = aclnn.aclCreateTensor(np.zeros((0, 4, 2, 8), np.float16))
    table = aclnn.aclCreateTensor(np.zeros((1, 4, 1, 8), np.float32))
    assert two_phase(*GRAD, dy, aclnn.aclCreateTensor(np.zeros((1, 4, 1, 8), np.int32)), table, 1, None) == 161002
    failure(161002, "cos")
    assert two_phase(*GRAD, dy, table, table, 1, aclnn.aclCreateIntArray([6, 2])) == 561002
    failure(561002, "RP-S5")
