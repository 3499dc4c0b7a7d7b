"""geir.torch's rotary calls: really in place, bits equal to geir.run, gradcheck of the functional form, errors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import geir  # noqa: E402
import geir.torch as gt  # noqa: E402

from .helpers import DTYPES, bits, run_op  # noqa: E402

B, S, N, D = 2, 5, 3, 24
SLICE = [4, 20]


def _tables(dtype, seed=0, length=SLICE[1] - SLICE[0]):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(1, S, 1, length, generator=g) * 6
    return angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("mode", sorted(gt.ROTARY_MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_forward_and_backward_equal_geir_run_bit_for_bit(mode, dtype):
    x = torch.randn(B, S, N, D).to(dtype)
    cos, sin = _tables(dtype)
    code = gt.ROTARY_MODES[mode]
    for call, op_type, name in ((gt.inplace_partial_rotary_mul, "InplacePartialRotaryMul", "x"),
                                (gt.inplace_partial_rotary_mul_backward, "InplacePartialRotaryMulGrad", "dy")):
        y = x.clone()
        assert call(y, cos, sin, rotary_mode=mode, partial_slice=SLICE) is None
        (ref,) = run_op(op_type, {name: x, "cos": cos, "sin": sin}, rotary_mode=code, partial_slice=SLICE)
        assert np.array_equal(bits(y), bits(ref))
        assert not torch.equal(y, x)


def test_mixed_dtypes_equal_geir_run():
    x = torch.randn(B, S, N, D).to(torch.bfloat16)
    cos, sin = _tables(torch.float32)
    y = x.clone()
    gt.inplace_partial_rotary_mul(y, cos, sin, partial_slice=SLICE)
    (ref,) = run_op("InplacePartialRotaryMul", {"x": x, "cos": cos, "sin": sin}, rotary_mode=1, partial_slice=SLICE)
    assert np.array_equal(bits(y), bits(ref))


def test_the_in_place_ops_write_through_the_callers_tensor_even_a_strided_view():
    base = torch.randn(B, S, 2 * N, D)
    view = base[:, :, ::2]                   # every other head: not contiguous
    expected = view.clone()
    cos, sin = _tables(torch.float32)
    gt.inplace_partial_rotary_mul(expected, cos, sin, partial_slice=SLICE)
    untouched = base[:, :, 1::2].clone()
    pointer = view.data_ptr()
    gt.inplace_partial_rotary_mul(view, cos, sin, partial_slice=SLICE)
    assert view.data_ptr() == pointer and torch.equal(view, expected) and torch.equal(base[:, :, ::2], expected)
    assert torch.equal(base[:, :, 1::2], untouched)
    before = (cos.clone(), sin.clone())
    gt.inplace_partial_rotary_mul_backward(view, cos, sin, partial_slice=SLICE)
    assert torch.equal(cos, before[0]) and torch.equal(sin, before[1])


@pytest.mark.parametrize("mode", sorted(gt.ROTARY_MODES))
def test_the_functional_form_is_differentiable_through_the_backward_op(mode):
    x = torch.randn(B, S, N, D, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(torch.float64)
    assert torch.autograd.gradcheck(
        lambda t: gt.partial_rotary_mul(t, cos, sin, rotary_mode=mode, partial_slice=SLICE), (x,))
    y = gt.partial_rotary_mul(x, cos, sin, rotary_mode=mode, partial_slice=SLICE)
    dy = torch.randn_like(y)
    y.backward(dy)
    expected = dy.clone()
    gt.inplace_partial_rotary_mul_backward(expected, cos, sin, rotary_mode=mode, partial_slice=SLICE)
    assert torch.equal(x.grad, expected)


def test_unknown_modes_and_bad_slices_are_rule_errors():
    x = torch.randn(B, S, N, D)
    cos, sin = _tables(torch.float32)
    with pytest.raises(geir.GraphError) as mode:
        gt.inplace_partial_rotary_mul(x, cos, sin, rotary_mode="neox", partial_slice=SLICE)
    assert mode.value.rule == "RP-S4"
    with pytest.raises(geir.GraphError) as length:
        gt.inplace_partial_rotary_mul(x, cos, sin, partial_slice=[0, 8])
    assert length.value.rule == "RP-S7"
    with pytest.raises(geir.GraphError) as rank:
        gt.inplace_partial_rotary_mul(x[0], cos, sin, partial_slice=SLICE)
    assert rank.value.rule == "RP-S1"


IN_PLACE = [gt.inplace_partial_rotary_mul, gt.inplace_partial_rotary_mul_backward]


@pytest.mark.parametrize("path", ["public", "op"])
@pytest.mark.parametrize("call", IN_PLACE, ids=lambda f: f.__name__)
def test_a_written_tensor_autograd_records_is_refused_not_silently_missed(call, path):
    cos, sin = _tables(torch.float32)
    rotate = call if path == "public" else call.op          # torch.ops.geir.<name>: its own Autograd kernel refuses
    leaf = torch.randn(B, S, N, D, requires_grad=True)
    for x in (leaf, leaf * 1):                     # a leaf, and a tensor autograd computed
        before = x.detach().clone()
        with pytest.raises(geir.ExecutionError, match="'(x|grad_output)' requires grad: autograd cannot record this in-place op") as e:
            rotate(x, cos, sin, partial_slice=SLICE)
        assert "partial_rotary_mul" in str(e.value) and "torch.no_grad()" in str(e.value)
        assert torch.equal(x.detach(), before)
    expected = leaf.detach().clone()
    call(expected, cos, sin, partial_slice=SLICE)
    with torch.no_grad():                          # as torch's own in-place ops: allowed where nothing is recorded
        rotate(leaf, cos, sin, partial_slice=SLICE)
    assert torch.equal(leaf.detach(), expected) and leaf.grad is None


@pytest.mark.parametrize("path", ["public", "op"])
@pytest.mark.parametrize("call", IN_PLACE, ids=lambda f: f.__name__)
def test_a_target_whose_elements_share_memory_is_refused(call, path):
    cos, sin = _tables(torch.float32)
    rotate = call if path == "public" else call.op
    expanded = torch.randn(B, S, N, 1).expand(B, S, N, D)
    overlapping = torch.randn(B * S * N * D).as_strided((B, S, N, D), (1, 2, 3, 1))
    for x in (expanded, overlapping):
        before = x.clone()
        with pytest.raises(geir.ExecutionError, match="more than one of its elements refers to the same memory"):
            rotate(x, cos, sin, partial_slice=SLICE)
        assert torch.equal(x, before)


@pytest.mark.parametrize("path", ["public", "op"])
def test_an_inference_tensor_is_rotated_in_place_only_in_inference_mode(path):
    cos, sin = _tables(torch.float32)
    rotate = gt.inplace_partial_rotary_mul if path == "public" else gt.inplace_partial_rotary_mul.op
    with torch.inference_mode():
        x = torch.randn(B, S, N, D)
    expected = x.clone()
    gt.inplace_partial_rotary_mul(expected, cos, sin, partial_slice=SLICE)
    with pytest.raises(geir.ExecutionError, match="inference tensor"):
        rotate(x, cos, sin, partial_slice=SLICE)
    with torch.inference_mode():
        rotate(x, cos, sin, partial_slice=SLICE)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("path", ["public", "op"])
def test_a_target_sharing_memory_with_a_table_is_refused(path):
    rotate = gt.inplace_partial_rotary_mul if path == "public" else gt.inplace_partial_rotary_mul.op
    x = torch.randn(B, S, N, D)
    cos, sin = _tables(torch.float32)
    for r1, r2 in ((x[:1, :, :1, SLICE[0]:SLICE[1]], sin), (cos, x[:1, :, 2:, :SLICE[1] - SLICE[0]])):
        before = x.clone()
        with pytest.raises(geir.ExecutionError, match="'x' may share memory with 'r[12]'"):
            rotate(x, r1, r2, partial_slice=SLICE)
        assert torch.equal(x, before)


def test_permuted_and_sliced_views_are_rotated_in_place_not_refused():
    cos, sin = _tables(torch.float32)
    base = torch.randn(B, N, S, D + 6)
    view = base.permute(0, 2, 1, 3)[..., 3:3 + D]            # (B, S, N, D): permuted, then sliced
    expected = view.clone()
    gt.inplace_partial_rotary_mul(expected, cos, sin, partial_slice=SLICE)
    gt.inplace_partial_rotary_mul(view, cos, sin, partial_slice=SLICE)
    assert torch.equal(view, expected) and torch.equal(base.permute(0, 2, 1, 3)[..., 3:3 + D], expected)


@pytest.mark.parametrize("path", ["public", "op"])
def test_a_table_that_requires_grad_or_a_forward_ad_tangent_is_refused(path):
    rotate = gt.inplace_partial_rotary_mul if path == "public" else gt.inplace_partial_rotary_mul.op
    cos, sin = _tables(torch.float64)
    x = torch.randn(B, S, N, D, dtype=torch.float64)
    before = x.clone()
    with pytest.raises(geir.ExecutionError, match="'r2' requires grad"):     # torch's x.mul_(w) would record w
        rotate(x, cos, sin.requires_grad_(), partial_slice=SLICE)
    sin = sin.detach()
    import warnings

    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        with warnings.catch_warnings():     # torch 2.13's first make_dual scripts its jvp decompositions with
            warnings.simplefilter("ignore", DeprecationWarning)     # the deprecated torch.jit.script
            dual = fwAD.make_dual(x.clone(), torch.ones_like(x))
        with pytest.raises(geir.ExecutionError, match="'x' carries a forward-AD tangent"):   # it would stay
            rotate(dual, cos, sin, partial_slice=SLICE)
    assert torch.equal(x, before)
