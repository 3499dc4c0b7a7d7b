"""``assert_close``: the precision standards CANN's own operator tests apply, by the names they use.

- ``"diff_ratio"`` (ops-transformer ``moe/moe_init_routing_v3/tests/ut/op_kernel/.../compare.py``):
  an element differs when ``isclose(actual, expected, rtol=p, atol=0, equal_nan=True)`` fails, and
  the output passes when the ratio of differing elements is below ``p``: ``p = 1/1000`` for float16
  and ``1/10000`` for every other dtype ("Diff ratio" in CANN's output). A differing infinity or NaN
  fails the output whatever the ratio (the special values below hold in every standard).
- ``"precision_standard"`` (ops-transformer ``posembedding/norm_rope_concat_grad/tests/ut/op_kernel/
  .../compare_data.py``, ``get_precision_standard``): every element within an absolute error that
  grows with the number of terms accumulated into it (``compute_count``): float16 ``2**-8`` below
  2048 terms, else ``2**-7``; bfloat16 ``2**-7`` / ``2**-6``; float32 ``2**-11`` below 2048, ``2**-10``
  below 16384, else ``2**-9``.
- ``"bit_exact"``: every element is exactly the expected value, what geir promises between its
  runtimes for the rotary ops. Of one dtype this is the same bits (any NaN equal to any NaN). Of two
  dtypes nothing is cast: the two numbers must be equal as numbers (int32 ``1`` against ``1.7`` fails,
  uint8 ``0`` against ``256.0`` fails, ``True`` against ``1.0`` passes), a floating zero must have the
  expected sign when both sides are floating, and a NaN matches only a NaN.

Special values, in every standard: equal infinities of one sign pass, an infinity against anything
else fails, a NaN passes only against a NaN in the same position. Shapes must be equal (nothing
broadcasts), and any memory layout (transposed, strided, big-endian) compares by value. Only bool,
integer and floating dtypes (ml_dtypes' included) are compared; anything else is refused.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["STANDARDS", "assert_close", "precision_standard"]

STANDARDS = ("diff_ratio", "precision_standard", "bit_exact")


def _name(dtype: np.dtype) -> str:
    return dtype.name          # "bfloat16" for ml_dtypes; byte order does not change the name ('>f2' is float16)


def _family(dtype: np.dtype, what: str) -> str:
    """'f' (floating), 'i' (integer or bool): the exact comparison domain of ``dtype``; refuses the rest."""
    if dtype.kind == "f":
        return "f"
    if dtype.kind in "biu":
        return "i"
    if dtype.kind == "V":          # ml_dtypes' types (bfloat16, float8, int4) say what they are
        for family, info in (("f", ml_dtypes.finfo), ("i", ml_dtypes.iinfo)):
            try:
                info(dtype)
                return family
            except (TypeError, ValueError):
                pass
    raise ValueError(f"assert_close: {what}: dtype: expected bool, an integer or a floating dtype, got {dtype}")


def _exact(array: np.ndarray, family: str) -> np.ndarray:
    """``array`` in a dtype holding each of its values exactly: float64 (longdouble), int64 or uint64."""
    if family == "f":
        return array.astype(np.longdouble if array.dtype.kind == "f" and array.dtype.itemsize > 8 else np.float64)
    return array.astype(np.uint64 if array.dtype.kind == "u" and array.dtype.itemsize == 8 else np.int64)


def _int_equals_float(n: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Where the integer ``n`` (int64 or uint64) is exactly the floating ``f``: finite, integral, in range."""
    info = np.iinfo(n.dtype)
    in_range = np.isfinite(f) & (np.floor(f) == f) & (f >= float(info.min)) & (f < float(int(info.max) + 1))
    return in_range & (np.where(in_range, f, 0).astype(n.dtype) == n)


def _same_values(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Elementwise: ``actual`` is exactly ``expected`` (the bit_exact rule of the module docstring)."""
    fa, fe = _family(actual.dtype, "actual"), _family(expected.dtype, "expected")
    a, e = _exact(actual, fa), _exact(expected, fe)
    if fa == fe == "f":
        return (a == e) & (np.signbit(a) == np.signbit(e)) | (np.isnan(a) & np.isnan(e))
    if fa == fe == "i":
        if a.dtype != e.dtype:        # int64 against uint64: equal only where the signed one is not negative
            signed, unsigned = (a, e) if a.dtype == np.int64 else (e, a)
            return (signed >= 0) & (np.where(signed >= 0, signed, 0).astype(np.uint64) == unsigned)
        return a == e
    return _int_equals_float(a, e) if fa == "i" else _int_equals_float(e, a)


def precision_standard(dtype: np.dtype | str, compute_count: int = 0) -> float:
    """The absolute error bound of CANN's ``get_precision_standard`` for ``dtype`` and ``compute_count``."""
    name = dtype if isinstance(dtype, str) else _name(np.dtype(dtype))
    if name == "float16":
        return 2.0 ** -8 if compute_count < 2048 else 2.0 ** -7
    if name == "bfloat16":
        return 2.0 ** -7 if compute_count < 2048 else 2.0 ** -6
    if name == "float32":
        return 2.0 ** -11 if compute_count < 2048 else 2.0 ** -10 if compute_count < 16384 else 2.0 ** -9
    raise ValueError(f"precision_standard: dtype: expected float16, bfloat16 or float32, got {name}")


def assert_close(actual: np.ndarray, expected: np.ndarray, *, dtype: np.dtype | str | None = None,
                 standard: str = "diff_ratio", compute_count: int = 0, name: str = "output") -> None:
    """Raise AssertionError unless ``actual`` meets ``standard`` against ``expected`` (the golden).

    ``dtype`` picks the thresholds (default: ``actual``'s). Shapes must be equal (nothing broadcasts); equal
    infinities of one sign pass, NaN passes only against NaN. ``bit_exact`` of two dtypes casts nothing: the
    numbers must be exactly equal (int32 1 against 1.7 fails). The message says how many elements failed,
    the worst index, actual, expected, absolute and relative error, and the standard.
    """
    if standard not in STANDARDS:
        raise ValueError(f"assert_close: standard: expected one of {', '.join(STANDARDS)}, got {standard!r}")
    actual, expected = np.asarray(actual), np.asarray(expected)
    fa, fe = _family(actual.dtype, "actual"), _family(expected.dtype, "expected")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {list(actual.shape)} differs from the expected {list(expected.shape)}")
    kind = _name(np.dtype(dtype)) if dtype is not None and not isinstance(dtype, str) else (dtype or _name(actual.dtype))
    a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
    same = (a64 == e64) | (np.isnan(a64) & np.isnan(e64))            # equal infinities of one sign: no error
    with np.errstate(invalid="ignore"):
        abs_err = np.where(same, 0.0, np.abs(a64 - e64))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_err = np.where(same, 0.0, np.where((e64 != 0) & ~np.isinf(abs_err), abs_err / np.abs(e64), np.inf))
    if standard == "bit_exact":
        bad = ~_same_values(actual, expected)
        mixed = "" if actual.dtype.newbyteorder("=") == expected.dtype.newbyteorder("=") else \
            f" (actual {_name(actual.dtype)}, expected {_name(expected.dtype)}: equal as numbers, nothing cast)"
        rule, ok = f"bit_exact: every element is exactly the expected value{mixed}", not bad.any()
    elif standard == "diff_ratio":
        p = 1e-3 if kind == "float16" else 1e-4
        bad = ~(same | np.isclose(a64, e64, rtol=p, atol=0, equal_nan=True))
        ratio = bad.mean() if bad.size else 0.0
        special = bad & ~(np.isfinite(a64) & np.isfinite(e64))     # an inf or NaN that differs: never a ratio
        rule, ok = f"diff_ratio ({kind}): elements with relative error > {p:g} must be fewer than {p:g} of all " \
                   f"(here {ratio:.3g}), and no infinity or NaN may differ", (ratio < p or not bad.any()) and \
            not special.any()
    else:
        bound = precision_standard(kind, compute_count)
        bad = ~(abs_err <= bound)
        rule, ok = f"precision_standard ({kind}, compute_count {compute_count}): |error| <= {bound:g}", not bad.any()
    if ok:
        return
    flat = int(np.argmax(np.where(bad, np.nan_to_num(abs_err, nan=np.inf, posinf=np.inf), -1.0)))
    worst = tuple(int(i) for i in np.unravel_index(flat, actual.shape)) if actual.ndim else ()
    error, relative = abs_err[worst], rel_err[worst]
    if fa == fe == "i":                                                    # exact, also beyond 2**53
        error, want = abs(int(actual[worst]) - int(expected[worst])), abs(int(expected[worst]))
        relative = error / want if want else np.inf
    raise AssertionError(f"{name}: {int(bad.sum())} of {bad.size} elements fail {rule}; worst at index "
                         f"{worst}: actual {_shown(actual, fa, worst)!r}, expected "
                         f"{_shown(expected, fe, worst)!r}, absolute error {error:.6g}, relative error {relative:.6g}")


def _shown(array: np.ndarray, family: str, index: tuple[int, ...]) -> object:
    """One element for the message: an integer in its own dtype, a floating value widened (exactly)."""
    return array[index] if family == "i" else _exact(np.asarray(array[index]), family)[()]
