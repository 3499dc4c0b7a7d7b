"""Numerics helpers: ulp distances and the project's tolerance rules against float64 references."""

from __future__ import annotations

import ml_dtypes
import numpy as np

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def ordered_bits(a: np.ndarray) -> np.ndarray:
    """Map floats to integers whose order and differences count representable values."""
    bits = a.view(_UINT[a.dtype.itemsize]).astype(np.int64)
    sign = np.int64(1) << (8 * a.dtype.itemsize - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


def ulp_distance(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """How many representable values of ``actual.dtype`` lie between the two (same dtype)."""
    assert actual.dtype == expected.dtype
    return np.abs(ordered_bits(actual) - ordered_bits(expected))


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        np.array_equal(a.view(_UINT[a.dtype.itemsize]), b.view(_UINT[b.dtype.itemsize])))


def bits_equal_or_both_nan(a: np.ndarray, b: np.ndarray) -> bool:
    """``bits_equal``, except that a NaN matches any NaN: IEEE 754 leaves open which payload and sign an operation
    on two NaNs returns (x86 returns its first operand's, and a compiler may commute a product), so only NaN-ness
    is the contract there; every other element must match bit for bit."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    return bool(np.array_equal(nan_a, nan_b)) and bits_equal(a[~nan_a], b[~nan_b])


F32_COMPUTE_EPS = 2.0 ** -22
"""Bound on the float32 compute error relative to the magnitude of the terms (two products, one sum)."""


def assert_matches_reference(actual: np.ndarray, ref64: np.ndarray, magnitude: np.ndarray, what: str = "", *,
                             ulps: int = 1, compute_rel: float = F32_COMPUTE_EPS, f32_rel: float = 1e-6) -> None:
    """The contract's tolerance: float32 within ``f32_rel`` relative to the terms' magnitude;
    float16/bfloat16 within ``ulps`` of the float64-then-round value, or within the float32
    compute error (``compute_rel`` x magnitude) where cancellation makes the result tiny next
    to its terms."""
    dt = actual.dtype
    a64 = actual.astype(np.float64)
    err = np.abs(a64 - ref64)
    if dt == np.float32:
        bad = err > f32_rel * magnitude + 1e-30
    else:
        rounded = ref64.astype(np.float32).astype(dt) if dt == ml_dtypes.bfloat16 else ref64.astype(dt)
        bad = (ulp_distance(actual, rounded) > ulps) & (err > compute_rel * magnitude)
    if bad.any():
        idx = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} element(s) off; first at {idx}: got {actual[idx]!r}, "
                             f"reference {ref64[idx]!r} (magnitude {magnitude[idx]!r}, dtype {dt})")


def _ulp_of_scale(x: np.ndarray, dtype) -> float:
    """The spacing of ``dtype`` at the largest magnitude of ``x``."""
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    if scale == 0:
        return 0.0
    dt = np.dtype(dtype)
    if dt == ml_dtypes.bfloat16:
        return 2.0 ** (np.floor(np.log2(scale)) - 7)
    return float(np.spacing(dt.type(scale)))


def assert_within_ulps_of_scale(got, want, dtype, ulps=2, what=""):
    """``got`` is within ``ulps`` units of ``dtype``'s precision at the scale of ``want``."""
    tol = ulps * _ulp_of_scale(want, dtype)
    err = np.max(np.abs(got.astype(np.float64) - want)) if want.size else 0.0
    assert err <= tol, f"{what}: max error {err} > {ulps} ulp(s) of the output scale ({tol})"
