"""``assert_close``: the precision standards CANN's own operator tests apply, by the names they use.

- ``"diff_ratio"`` (ops-transformer ``moe/moe_init_routing_v3/tests/ut/op_kernel/.../compare.py``):
  an element differs when ``isclose(actual, expected, rtol=p, atol=0, equal_nan=True)`` fails, and
  the output passes when the ratio of differing elements is below ``p``: ``p = 1/1000`` for float16
  and ``1/10000`` for every other dtype ("Diff ratio" in CANN's output).
- ``"precision_standard"`` (ops-transformer ``posembedding/norm_rope_concat_grad/tests/ut/op_kernel/
  .../compare_data.py``, ``get_precision_standard``): every element within an absolute error that
  grows with the number of terms accumulated into it (``compute_count``): float16 ``2**-8`` below
  2048 terms, else ``2**-7``; bfloat16 ``2**-7`` / ``2**-6``; float32 ``2**-11`` below 2048, ``2**-10``
  below 16384, else ``2**-9``.
- ``"bit_exact"``: the same bits (NaN equal to NaN), what geir promises between its runtimes for
  the rotary ops.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["STANDARDS", "assert_close", "precision_standard"]

STANDARDS = ("diff_ratio", "precision_standard", "bit_exact")


def _name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == ml_dtypes.bfloat16 else str(dtype)


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

    ``dtype`` picks the thresholds (default: ``actual``'s). The message says how many elements
    failed, the worst index, actual, expected, absolute and relative error, and the standard.
    """
    if standard not in STANDARDS:
        raise ValueError(f"assert_close: standard: expected one of {', '.join(STANDARDS)}, got {standard!r}")
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {list(actual.shape)} differs from the expected {list(expected.shape)}")
    kind = _name(np.dtype(dtype)) if dtype is not None and not isinstance(dtype, str) else (dtype or _name(actual.dtype))
    a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
    abs_err = np.abs(a64 - e64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_err = np.where(e64 != 0, abs_err / np.abs(e64), np.where(abs_err == 0, 0.0, np.inf))
    both_nan = np.isnan(a64) & np.isnan(e64)
    abs_err, rel_err = np.where(both_nan, 0.0, abs_err), np.where(both_nan, 0.0, rel_err)
    if standard == "bit_exact":
        same = (actual.view(np.uint8).reshape(actual.shape + (-1,)) == expected.astype(actual.dtype).view(np.uint8)
                .reshape(actual.shape + (-1,))).all(axis=-1) | both_nan
        bad, rule, ok = ~same, "bit_exact: every element has the expected bits", not (~same).any()
    elif standard == "diff_ratio":
        p = 1e-3 if kind == "float16" else 1e-4
        bad = ~np.isclose(a64, e64, rtol=p, atol=0, equal_nan=True)
        ratio = bad.mean() if bad.size else 0.0
        rule, ok = f"diff_ratio ({kind}): elements with relative error > {p:g} must be fewer than {p:g} of all " \
                   f"(here {ratio:.3g})", ratio < p or not bad.any()
    else:
        bound = precision_standard(kind, compute_count)
        bad = ~(abs_err <= bound)
        rule, ok = f"precision_standard ({kind}, compute_count {compute_count}): |error| <= {bound:g}", not bad.any()
    if ok:
        return
    worst = np.unravel_index(int(np.argmax(np.where(bad, np.nan_to_num(abs_err, nan=np.inf, posinf=np.inf), -1.0))),
                             actual.shape) if actual.ndim else ()
    raise AssertionError(f"{name}: {int(bad.sum())} of {bad.size} elements fail {rule}; worst at index "
                         f"{tuple(int(i) for i in worst)}: actual {a64[worst]!r}, expected {e64[worst]!r}, "
                         f"absolute error {abs_err[worst]:.6g}, relative error {rel_err[worst]:.6g}")
