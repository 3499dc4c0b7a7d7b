"""The native matrix multiply behind the attention kernels (gemm.c), through its test hook: exact on every
operand form it copies or reads in place (strided or row-major A, dense or gathered B, blocks of rows and
of p, a half-width last panel, accumulation), and the copies change no bit."""

from __future__ import annotations

import ctypes
import functools
import itertools

import numpy as np
import pytest

from geir.runtimes.onnxruntime import native_library
from native_helpers import requires_compiler

pytestmark = requires_compiler

KC, MC, PACK_B_MIN_ROWS = 256, 120, 24   # gemm.h / gemm.c: blocks of p and of rows, rows from which B is copied


@functools.cache
def _lib() -> ctypes.CDLL:
    """The loaded native library with the hooks' signatures declared (once per process)."""
    lib = ctypes.CDLL(native_library())
    lib.geir_fail_allocation.argtypes = [ctypes.c_long]
    lib.geir_gemm_rows.restype = ctypes.c_int
    lib.geir_gemm_rows.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                          ctypes.c_int64, ctypes.c_int]
    return lib


def _vector() -> int:
    return _lib().geir_gemm_vector_floats()


def gemm(a: np.ndarray, a_row: int, a_step: int, b: np.ndarray, offsets: np.ndarray, c: np.ndarray, m: int,
         n: int, k: int, accumulate: bool = False) -> None:
    """C (rows of c) = or += A B with A(i, p) = a.flat[i * a_row + p * a_step] and row p of B at b.flat[offsets[p]]."""
    for array in (a, b, c):
        assert array.dtype == np.float32 and array.flags.c_contiguous
    offsets = np.ascontiguousarray(offsets, np.int64)
    status = _lib().geir_gemm_rows(m, n, k, a.ctypes.data, a_row, a_step, b.ctypes.data, offsets.ctypes.data,
                                   c.ctypes.data, c.shape[-1], int(accumulate))
    assert status == 0


def _a_operand(form: str, values: np.ndarray) -> tuple[np.ndarray, int, int]:
    """``values`` (m x k) stored as the kernels store A: rows (a_step 1, padded), or transposed with a column
    stride of one cache line (read in place) or of 128 floats (copied into tiles)."""
    m, k = values.shape
    if form == "rows":
        stored = np.zeros((m, k + 5), np.float32)
        stored[:, :k] = values
        return stored, k + 5, 1
    stride = 16 if form == "transposed_line" else 128
    assert m <= stride
    stored = np.zeros((k, stride), np.float32)
    stored[:, :m] = values.T
    return stored, 1, stride


def _b_operand(form: str, values: np.ndarray, rng, repeats: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``values`` (k x n) as rows: dense at their own width, dense 128 floats apart (512 bytes: a panel would
    leave L1), or gathered from a pool in random order (with ``repeats``, some rows of B are one pool row:
    ``values`` is updated to what B then holds)."""
    k, n = values.shape
    if form == "dense":
        return np.ascontiguousarray(values), np.arange(k) * n
    if form == "dense_wide":
        stored = np.zeros((k, max(128, n)), np.float32)
        stored[:, :n] = values
        return stored, np.arange(k) * stored.shape[1]
    width = n + 24                        # 2 KiB-ish rows at an arbitrary stride, as the widened keys
    pool_rows = rng.choice(4 * k + 8, size=k, replace=repeats)
    pool = np.zeros((4 * k + 8, width), np.float32)
    unique, first = np.unique(pool_rows, return_index=True)
    for row, p in zip(unique, first):
        pool[row, :n] = values[p]
    values[:] = pool[pool_rows, :n]                  # a repeated pool row holds its first occurrence's row
    return pool, pool_rows * width


def _sixteenths(rng, shape) -> np.ndarray:
    """Multiples of 1/16 in [-1/2, 1/2]: every product and partial sum below is exact in float32, so the
    kernel must equal the float64 product exactly, whatever its summation order or contraction."""
    return (rng.integers(-8, 9, size=shape) / 16).astype(np.float32)


SHAPES = [  # (m, vectors of n, k): one tile, short tiles, several row blocks, several p blocks, a half panel
    (1, 1, 1), (5, 2, 7), (16, 16, 256), (24, 3, 300), (64, 4, 40), (121, 5, 257), (250, 2, 600),
]


A_STORE_ROWS = {"rows": None, "transposed_line": 16, "transposed_wide": 128}   # most rows a transposed store holds
CASES = [(a, b, *shape, acc) for a, b, shape, acc in itertools.product(A_STORE_ROWS, ("dense", "dense_wide", "gathered"),
                                                                       SHAPES, (False, True))
         if A_STORE_ROWS[a] is None or shape[0] <= A_STORE_ROWS[a]]


@pytest.mark.parametrize("a_form,b_form,m,vectors,k,accumulate", CASES)
def test_the_product_is_exact_on_every_operand_form(a_form, b_form, m, vectors, k, accumulate):
    rng = np.random.default_rng(m * 1000 + vectors * 10 + k)
    n = vectors * _vector()
    a_values, b_values = _sixteenths(rng, (m, k)), _sixteenths(rng, (k, n))
    a, a_row, a_step = _a_operand(a_form, a_values)
    b, offsets = _b_operand(b_form, b_values, rng)
    start = _sixteenths(rng, (m, n)) if accumulate else np.full((m, n), np.nan, np.float32)
    c = start.copy()
    gemm(a, a_row, a_step, b, offsets, c, m, n, k, accumulate)
    want = a_values.astype(np.float64) @ b_values.astype(np.float64) + (start if accumulate else 0)
    np.testing.assert_array_equal(c, want.astype(np.float32))


@pytest.mark.parametrize("m,k", [(PACK_B_MIN_ROWS, 200), (MC + 10, KC + 30), (200, 90)])
def test_copying_the_operands_changes_no_bit(m, k):
    """Random floats (inexact sums): B read in place (dense rows one panel wide) and copied (the same rows
    gathered), A read as rows and copied from a wide transposed store, give identical bits."""
    rng = np.random.default_rng(m + k)
    n = 2 * _vector()                                    # one full panel: dense rows at their width stay in place
    a_values = rng.standard_normal((m, k)).astype(np.float32)
    b_values = rng.standard_normal((k, n)).astype(np.float32)
    results = []
    for a_form in ("rows", "transposed_wide") if m <= 128 else ("rows",):
        for b_form in ("dense", "gathered"):
            a, a_row, a_step = _a_operand(a_form, a_values)
            b, offsets = _b_operand(b_form, b_values.copy(), np.random.default_rng(0), repeats=False)
            c = np.empty((m, n), np.float32)
            gemm(a, a_row, a_step, b, offsets, c, m, n, k)
            results.append(c)
    reference = a_values.astype(np.float64) @ b_values.astype(np.float64)
    assert np.abs(results[0] - reference).max() <= 1e-4 * np.abs(reference).max()
    for other in results[1:]:
        np.testing.assert_array_equal(other.view(np.uint32), results[0].view(np.uint32))


def test_a_failed_allocation_is_reported():
    lib = _lib()
    a = np.ones((8, 8), np.float32)
    c = np.zeros((8, _vector()), np.float32)
    offsets = np.zeros(8, np.int64)
    lib.geir_fail_allocation(0)
    try:
        status = lib.geir_gemm_rows(8, _vector(), 8, a.ctypes.data, 8, 1, a.ctypes.data, offsets.ctypes.data,
                                       c.ctypes.data, _vector(), 0)
    finally:
        lib.geir_fail_allocation(-1)
    assert status == -1
    assert not c.any()                                  # nothing was computed into C
