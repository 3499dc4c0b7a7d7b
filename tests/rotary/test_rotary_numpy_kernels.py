"""The rotary kernels against the spec's examples, the float64 reference and the spec's identities."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

import geir
from geir.runtimes.numpy import rotary as kernels
from geir.runtimes.numpy.rotary import rotary_mul, rotary_mul_grad
from geir.schemas.rotary.examples import E1_COS, E1_DY, E1_ROWS, E1_SIN, E2_COS, E2_ROWS, E2_SIN, E2_X
from oracles.numerics import assert_matches_reference, bits_equal
from oracles.rotary import rotary_reference
from rotary.helpers import ROPE, ROPE_GRAD, empty_grad_slices_expected, rotary_graph

BF16 = ml_dtypes.bfloat16
FWD_COMBOS = [("float16", "float16"), ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"),
              ("bfloat16", "float32")]
GRAD_COMBOS = [(d, c) for d in ("float16", "float32", "bfloat16") for c in ("float16", "float32", "bfloat16")]
PATTERNS = list(itertools.product((False, True), repeat=3))  # which of (B, S, N) cos keeps


def _run(op, x, cos, sin, **attrs):
    g = rotary_graph(op, x.shape, cos.shape, x.dtype, cos.dtype, **attrs)
    return geir.run(g, {"x": x, "cos": cos, "sin": sin})["y"]


def _check_against_reference(op, x, cos, sin, mode, start, end):
    y = _run(op, x, cos, sin, rotary_mode=mode, partial_slice=[start, end])
    ref, mag = rotary_reference(x, cos, sin, mode, start, end, op == ROPE_GRAD)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert bits_equal(y[..., :start], x[..., :start]) and bits_equal(y[..., end:], x[..., end:])
    assert_matches_reference(y[..., start:end], ref[..., start:end], mag[..., start:end],
                             f"{op} mode {mode} {x.dtype}/{cos.dtype} slice [{start},{end})")
    return y


def _data(shape, cos_shape, dtype, cos_dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(geir.as_dtype(dtype).numpy)
    cos = rng.uniform(-1, 1, cos_shape).astype(geir.as_dtype(cos_dtype).numpy)
    sin = rng.uniform(-1, 1, cos_shape).astype(geir.as_dtype(cos_dtype).numpy)
    return x, cos, sin


# -- worked examples (spec 2.5), from the family's declared examples ------------------------------
@pytest.mark.parametrize("mode", range(4))
def test_e1_cann_example_every_mode(mode):
    dy, cos, sin = (a.astype(np.float32) for a in (E1_DY, E1_COS, E1_SIN))
    grad_row, fwd_row = E1_ROWS[mode]
    for op, row in ((ROPE_GRAD, grad_row), (ROPE, fwd_row)):
        y = _run(op, dy, cos, sin, rotary_mode=mode, partial_slice=[2, 6])
        np.testing.assert_allclose(y, np.tile(np.array(row, np.float32), (2, 2, 2, 1)), rtol=1e-6)


@pytest.mark.parametrize("mode", range(4))
def test_e2_separates_all_modes(mode):
    x, cos, sin = (a.astype(np.float32) for a in (E2_X, E2_COS, E2_SIN))
    grad_row, fwd_row = E2_ROWS[mode]
    np.testing.assert_allclose(_run(ROPE_GRAD, x, cos, sin, rotary_mode=mode, partial_slice=[0, 8]).ravel(),
                               grad_row, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_run(ROPE, x, cos, sin, rotary_mode=mode, partial_slice=[0, 8]).ravel(),
                               fwd_row, rtol=1e-6, atol=1e-6)


def test_e3_ge_ir_example():
    ones = np.ones((1, 1, 1, 128), np.float32)
    y = _run(ROPE_GRAD, 2 * ones, ones, 0 * ones, rotary_mode=1, partial_slice=[0, 128])
    assert np.array_equal(y, 2 * ones)


@empty_grad_slices_expected
@pytest.mark.parametrize("op", [ROPE, ROPE_GRAD])
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_e4_and_empty_slices_are_bit_exact_identity(op, dtype):
    x, cos, sin = _data((2, 2, 2, 8), (1, 2, 1, 4), dtype, dtype)
    x[0, 0, 0, 0] = np.nan
    assert bits_equal(_run(op, x, cos, sin), x)  # default attributes: mode 0, slice [0, 0]
    assert bits_equal(_run(op, x, cos, sin, rotary_mode=1, partial_slice=[3, 3]), x)


# -- CANN test shapes (spec 2.6) -----------------------------------------------------------
GRAD_ST = [  # (dtype, cos dtype, dy shape, cos shape, slice)
    ("float32", "float32", (1, 1, 1, 128), (1, 1, 1, 128), (0, 128)),
    ("float16", "float16", (2, 4, 8, 128), (1, 1, 1, 128), (0, 128)),
    ("float32", "float32", (1, 1, 1, 128), (1, 1, 1, 64), (32, 96)),
    ("float32", "float32", (2, 3, 4, 64), (1, 1, 1, 48), (16, 64)),
    ("float16", "float16", (2, 4, 8, 128), (2, 1, 8, 128), (0, 128)),
    ("float16", "float16", (2, 4, 8, 128), (2, 4, 1, 128), (0, 128)),
    ("float32", "float32", (1, 2, 3, 64), (1, 2, 3, 64), (0, 64)),
    ("float32", "float32", (1, 1, 1, 32), (1, 1, 1, 16), (8, 24)),
    ("bfloat16", "bfloat16", (1, 2, 4, 128), (1, 1, 1, 128), (0, 128)),
    ("bfloat16", "float32", (1, 2, 4, 128), (1, 1, 1, 128), (0, 128)),
    ("bfloat16", "bfloat16", (1, 3, 5, 64), (1, 1, 1, 30), (10, 40)),
    ("float32", "float32", (1, 1, 1, 128), (1, 1, 1, 62), (6, 68)),
    ("float32", "float32", (2, 2, 2, 128), (1, 1, 1, 64), (7, 71)),
    ("float16", "float16", (2, 3, 4, 96), (1, 1, 1, 46), (25, 71)),
]
GRAD_UT = [(d, c, (2, 2, 2, 8), cs, (2, 6)) for d, c in (("float32", "float32"), ("float16", "float32"))
           for cs in ((1, 2, 1, 4), (2, 1, 1, 4), (2, 1, 2, 4), (1, 1, 2, 4))]
GRAD_UT += [("float32", "float32", (2, 2, 2, 4), (2, 2, 2, 4), (0, 4)),
            ("float32", "float32", (2, 2, 2, 4), (1, 1, 1, 4), (0, 4))]
FWD_UT = [("float32", "float32", (2, 4, 8, 128), (2, 4, 8, 128), (0, 128)),
          ("float32", "float32", (2, 4, 8, 128), (1, 1, 1, 128), (0, 128)),
          ("float32", "float32", (2, 4, 8, 128), (1, 4, 1, 64), (32, 96)),
          ("float32", "float32", (2, 4, 8, 128), (2, 4, 8, 64), (32, 96)),
          ("bfloat16", "float32", (2, 4, 8, 128), (1, 1, 1, 128), (0, 128)),
          ("float16", "float32", (2, 4, 8, 128), (1, 4, 1, 64), (32, 96)),
          ("float32", "float32", (1, 1, 1, 128), (1, 1, 1, 128), (0, 128))]


@pytest.mark.parametrize("dtype, cos_dtype, shape, cos_shape, pslice", GRAD_ST + GRAD_UT)
def test_cann_grad_shapes(dtype, cos_dtype, shape, cos_shape, pslice):
    x, cos, sin = _data(shape, cos_shape, dtype, cos_dtype)
    _check_against_reference(ROPE_GRAD, x, cos, sin, 1, *pslice)


@pytest.mark.parametrize("dtype, cos_dtype, shape, cos_shape, pslice", FWD_UT)
def test_cann_forward_shapes(dtype, cos_dtype, shape, cos_shape, pslice):
    x, cos, sin = _data(shape, cos_shape, dtype, cos_dtype)
    _check_against_reference(ROPE, x, cos, sin, 1, *pslice)


# -- every mode x dtype combination x broadcast pattern ----------------------------------------
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("op, dtype, cos_dtype", [(ROPE, d, c) for d, c in FWD_COMBOS]
                         + [(ROPE_GRAD, d, c) for d, c in GRAD_COMBOS])
def test_every_mode_dtype_and_broadcast_pattern(op, mode, dtype, cos_dtype):
    shape = (2, 3, 4, 21)
    start, end = 5, 13  # odd offset; L = 8 works in every mode
    for keep in PATTERNS:
        cos_shape = tuple(d if k else 1 for d, k in zip(shape[:3], keep)) + (end - start,)
        x, cos, sin = _data(shape, cos_shape, dtype, cos_dtype, seed=hash(keep) % 1000)
        _check_against_reference(op, x, cos, sin, mode, start, end)


@pytest.mark.parametrize("pslice, mode", [(p, m) for p in ((1, 9), (7, 71), (25, 71), (0, 4), (124, 128), (3, 127))
                                           for m in range(4) if m != 2 or (p[1] - p[0]) % 4 == 0])
def test_slices_at_odd_offsets(pslice, mode):
    for op in (ROPE, ROPE_GRAD):
        x, cos, sin = _data((2, 3, 2, 128), (1, 3, 1, pslice[1] - pslice[0]), "bfloat16", "float32")
        _check_against_reference(op, x, cos, sin, mode, *pslice)


def test_blocking_boundaries_match_the_reference(monkeypatch):
    """Tiny blocks: row blocks that split S, span batches, and end ragged; threads on."""
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 40)
    monkeypatch.setenv("GEIR_NUM_THREADS", "2")
    for shape, cos_shape in (((3, 7, 2, 16), (3, 7, 1, 8)), ((5, 2, 1, 16), (1, 2, 1, 8)), ((2, 9, 3, 16), (2, 1, 3, 8))):
        for mode in range(4):
            for op in (ROPE, ROPE_GRAD):
                x, cos, sin = _data(shape, cos_shape, "float16", "float32", seed=mode)
                _check_against_reference(op, x, cos, sin, mode, 4, 12)


def test_nan_and_inf_follow_ieee_and_stay_in_their_pair():
    x, cos, sin = _data((1, 1, 1, 16), (1, 1, 1, 8), "float32", "float32")
    x[0, 0, 0, 4] = np.inf    # slice position 0: pair (0, 1) in mode 1
    x[0, 0, 0, 1] = np.nan    # outside the slice: copied
    y = rotary_mul_grad(x, cos, sin, rotary_mode=1, partial_slice=(4, 12))
    assert np.isnan(y[0, 0, 0, 1]) and np.all(np.isinf(y[0, 0, 0, 4:6]))
    assert np.all(np.isfinite(y[0, 0, 0, 6:12]))


# -- identities (spec 6) in float64 -----------------------------------------------------------
def _tables(rng, cos_shape, duplicated_mode=None, unit=False):
    if duplicated_mode is None:
        c, n = rng.uniform(-1, 1, cos_shape), rng.uniform(-1, 1, cos_shape)
    else:
        from oracles.rotary import pair_indices
        a, b = pair_indices(duplicated_mode, cos_shape[-1])
        theta = rng.uniform(-3, 3, cos_shape)
        theta[..., b] = theta[..., a]
        c, n = np.cos(theta), np.sin(theta)
        if not unit:
            c, n = 0.7 * c, 1.3 * n
    return c, n


@pytest.mark.parametrize("mode", range(4))
def test_adjointness_in_float64(mode):
    rng = np.random.default_rng(mode)
    for trial in range(12):
        shape = (2, 3, 2, int(rng.integers(8, 40)))
        length = 4 * int(rng.integers(1, shape[3] // 4 + 1))
        start = int(rng.integers(0, shape[3] - length + 1))
        keep = PATTERNS[trial % 8]
        cos_shape = tuple(d if k else 1 for d, k in zip(shape[:3], keep)) + (length,)
        c, n = _tables(rng, cos_shape)
        x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
        attrs = dict(rotary_mode=mode, partial_slice=(start, start + length))
        lhs = np.vdot(rotary_mul(x, c, n, **attrs), dy)
        rhs = np.vdot(x, rotary_mul_grad(dy, c, n, **attrs))
        assert abs(lhs - rhs) <= 1e-12 * (abs(lhs) + 1), (trial, lhs, rhs)


@pytest.mark.parametrize("mode", range(3))
def test_partner_sin_trap(mode):
    """With pair-duplicated tables grad(dy) == fwd(dy; -sin) in modes 0-2; with general tables it must not."""
    rng = np.random.default_rng(10 + mode)
    dy = rng.standard_normal((2, 3, 2, 16))
    attrs = dict(rotary_mode=mode, partial_slice=(0, 16))
    c, n = _tables(rng, (1, 3, 1, 16), duplicated_mode=mode)
    np.testing.assert_allclose(rotary_mul_grad(dy, c, n, **attrs), rotary_mul(dy, c, -n, **attrs), rtol=1e-13, atol=1e-13)
    c, n = _tables(rng, (1, 3, 1, 16))
    assert not np.allclose(rotary_mul_grad(dy, c, n, **attrs), rotary_mul(dy, c, -n, **attrs), atol=1e-3)


@pytest.mark.parametrize("mode", range(4))
def test_grad_inverts_forward_on_the_unit_circle(mode):
    rng = np.random.default_rng(20 + mode)
    x = rng.standard_normal((2, 3, 2, 24))
    c, n = _tables(rng, (2, 1, 1, 16), duplicated_mode=0 if mode == 3 else mode, unit=True)
    attrs = dict(rotary_mode=mode, partial_slice=(4, 20))
    np.testing.assert_allclose(rotary_mul_grad(rotary_mul(x, c, n, **attrs), c, n, **attrs), x, rtol=0, atol=1e-13)


@pytest.mark.parametrize("grad", [False, True])
def test_mode2_is_mode0_on_each_half(grad):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 2, 3, 20))
    c, n = rng.uniform(-1, 1, (1, 2, 3, 16)), rng.uniform(-1, 1, (1, 2, 3, 16))
    fn = rotary_mul_grad if grad else rotary_mul
    quarter = fn(x, c, n, rotary_mode=2, partial_slice=(2, 18))
    halves = fn(x, c[..., :8], n[..., :8], rotary_mode=0, partial_slice=(2, 10))
    halves = fn(halves, c[..., 8:], n[..., 8:], rotary_mode=0, partial_slice=(10, 18))
    np.testing.assert_array_equal(quarter, halves)


def test_mode3_formulas():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 2, 3, 12))
    c, n = rng.uniform(-1, 1, (2, 1, 3, 12)), rng.uniform(-1, 1, (2, 1, 3, 12))
    expected = np.concatenate([x[..., 0::2], x[..., 1::2]], -1) * c + np.concatenate([-x[..., 1::2], x[..., 0::2]], -1) * n
    np.testing.assert_allclose(rotary_mul(x, c, n, rotary_mode=3, partial_slice=(0, 12)), expected, rtol=1e-14, atol=1e-14)
    half = rotary_mul_grad(x, c, n, rotary_mode=0, partial_slice=(0, 12))
    interleaved = np.empty_like(half)
    interleaved[..., 0::2], interleaved[..., 1::2] = half[..., :6], half[..., 6:]
    np.testing.assert_array_equal(rotary_mul_grad(x, c, n, rotary_mode=3, partial_slice=(0, 12)), interleaved)


# -- in place ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mode", range(4))
def test_kernel_in_place_equals_out_of_place(dtype, mode):
    x, cos, sin = _data((2, 5, 3, 40), (2, 5, 1, 16), dtype, dtype)
    for fn in (rotary_mul, rotary_mul_grad):
        expected = fn(x, cos, sin, rotary_mode=mode, partial_slice=(8, 24))
        buffer = x.copy()
        assert fn(buffer, cos, sin, rotary_mode=mode, partial_slice=(8, 24), out=buffer) is buffer
        assert bits_equal(buffer, expected)


def test_float32_results_are_bit_identical_to_the_spec_formula():
    """The kernel's products and sum are the spec's, in float32: compare bits, not tolerances."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 3, 32)).astype(np.float32)
    c = rng.uniform(-1, 1, (1, 4, 1, 32)).astype(np.float32)
    n = rng.uniform(-1, 1, (1, 4, 1, 32)).astype(np.float32)
    from oracles.rotary import pair_indices
    for mode in range(3):
        a, b = pair_indices(mode, 32)
        cb, nb = np.broadcast_to(c, x.shape), np.broadcast_to(n, x.shape)
        y = np.empty_like(x)
        y[..., a] = cb[..., a] * x[..., a] + nb[..., b] * x[..., b]
        y[..., b] = cb[..., b] * x[..., b] - nb[..., a] * x[..., a]
        assert bits_equal(rotary_mul_grad(x, c, n, rotary_mode=mode, partial_slice=(0, 32)), y)
