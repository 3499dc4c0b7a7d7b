"""NumPy kernels for InplacePartialRotaryMul and InplacePartialRotaryMulGrad (spec 2.4).

Every mode is written as ``y = c * g + m * swap(g)`` on the slice, where ``swap`` exchanges
each position with its rotation partner and ``m`` is a per-call table derived from ``sin``:
forward ``m = -sign * sin``, grad ``m = sign * swap(sin)`` (the partner's sin), with
``sign = +1`` on the first element of each pair and ``-1`` on the second. Each term is the
same float32 product as the spec's formula, so results are bit-identical to it.
Mode 3 reads (forward) or writes (grad) the interleaved layout around the half-mode math.
The pair views (``_pairs``) are tested bit for bit against ``schemas.rotary.rotation.rotate``,
the family's one statement of the tables, from which the signs are taken.

The work is blocked over rows of (B, S) so temporaries stay in cache; cos/sin broadcast
by NumPy, never materialised at full size. float64 inputs compute in float64 (test hook).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ...schemas import rotary as schemas
from ...schemas.rotary.rotation import rotation_tables
from . import _pool as pool
from ._kernels import kernel
from ._parallel import parallel_for

__all__ = ["rotary_mul", "rotary_mul_grad"]

BLOCK_ELEMENTS = 1 << 18
"""Slice elements per block (two float32 temporaries of 1 MiB): measured best on the issue's
shapes; smaller blocks lose to per-call overhead and thread hand-offs."""

_PAIR_KIND = {0: "half", 1: "interleave", 2: "quarter", 3: "half"}


_MODE = schemas.FORWARD.attribute("rotary_mode").default       # defaults come from the declarations
_SLICE = schemas.FORWARD.attribute("partial_slice").default
_GRAD_SLICE = schemas.GRAD.attribute("partial_slice").default


@kernel(schemas.FORWARD)
def rotary_mul(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, rotary_mode: int = _MODE,
               partial_slice: Sequence[int] = _SLICE, out: np.ndarray | None = None) -> np.ndarray:
    """Forward rotary embedding of ``x[..., start:end]``; returns ``out`` (x may be passed as out)."""
    return _rotary(x, cos, sin, rotary_mode, partial_slice, out, grad=False)


@kernel(schemas.GRAD)
def rotary_mul_grad(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, rotary_mode: int = _MODE,
                    partial_slice: Sequence[int] = _GRAD_SLICE, out: np.ndarray | None = None) -> np.ndarray:
    """Gradient of the rotary embedding on ``dy[..., start:end]``; returns ``out`` (dy may be out)."""
    return _rotary(dy, cos, sin, rotary_mode, partial_slice, out, grad=True)


def _pairs(arr: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Views of the first and second elements of every rotation pair on the last axis."""
    length = arr.shape[-1]
    if kind == "half":
        return arr[..., : length // 2], arr[..., length // 2 :]
    if kind == "interleave":
        pairs = arr.reshape(arr.shape[:-1] + (length // 2, 2))
        return pairs[..., 0], pairs[..., 1]
    quarters = arr.reshape(arr.shape[:-1] + (2, 2, length // 4))   # pairs (i, i+q) and (2q+i, 3q+i)
    return quarters[..., 0, :], quarters[..., 1, :]


def _swap(src: np.ndarray, dst: np.ndarray, kind: str) -> None:
    """``dst[..., a] = src[..., b]`` and ``dst[..., b] = src[..., a]`` for every pair (a, b)."""
    src_a, src_b = _pairs(src, kind)
    dst_a, dst_b = _pairs(dst, kind)
    np.copyto(dst_a, src_b, casting="unsafe")
    np.copyto(dst_b, src_a, casting="unsafe")


def _row_blocks(batch: int, seq: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """(batch slice, seq slice) blocks of about ``rows`` (b, s) rows each."""
    if rows >= seq:
        step = max(1, rows // max(seq, 1))
        for b0 in range(0, batch, step):
            yield slice(b0, min(b0 + step, batch)), slice(None)
    else:
        for b in range(batch):
            for s0 in range(0, seq, rows):
                yield slice(b, b + 1), slice(s0, min(s0 + rows, seq))


def _rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: int, partial_slice: Sequence[int],
            out: np.ndarray | None, *, grad: bool) -> np.ndarray:
    start, end = schemas.slice_bounds(partial_slice, x.shape[-1])
    in_place = out is x
    if out is None:
        out = pool.empty(x.shape, x.dtype)   # memory earlier results let go of, when there is some
    length = end - start
    if length == 0 or x.size == 0 or cos.size == 0 or sin.size == 0:   # the identity (schemas.rotary.grad_is_noop)
        if not in_place:
            np.copyto(out, x)
        return out
    cdt = np.dtype(np.float64 if x.dtype == np.float64 else np.float32)
    kind = _PAIR_KIND[mode]
    sign = rotation_tables(mode, length).sign.astype(cdt)   # the family's statement of the pairs
    c = np.asarray(cos, dtype=cdt)
    n = np.asarray(sin, dtype=cdt)
    m = np.empty(n.shape, cdt)
    if grad:
        _swap(n, m, kind)
        m *= sign
    else:
        np.multiply(n, -sign, out=m)
    read_interleaved = mode == 3 and not grad
    write_interleaved = mode == 3 and grad
    h = length // 2
    widen = x.dtype != cdt

    batch, seq, heads = x.shape[0], x.shape[1], x.shape[2]
    rows = max(1, BLOCK_ELEMENTS // max(1, heads * length))
    blocks = list(_row_blocks(batch, seq, rows))

    def run_blocks(chunk: list[tuple[slice, slice]]) -> None:
        capacity = max(x[bs, ss, :, start:end].size for bs, ss in chunk)
        gbuf = np.empty(capacity, cdt)
        tbuf = np.empty(capacity, cdt)
        for bs, ss in chunk:
            xb, ob = x[bs, ss], out[bs, ss]
            cb = c[bs if c.shape[0] > 1 else slice(None), ss if c.shape[1] > 1 else slice(None)]
            mb = m[bs if m.shape[0] > 1 else slice(None), ss if m.shape[1] > 1 else slice(None)]
            xs = xb[..., start:end]
            g = gbuf[: xs.size].reshape(xs.shape)
            t = tbuf[: xs.size].reshape(xs.shape)
            if read_interleaved:                   # forward mode 3: de-interleave, then half math
                np.copyto(g[..., :h], xs[..., 0::2], casting="unsafe")
                np.copyto(g[..., h:], xs[..., 1::2], casting="unsafe")
            elif widen:                            # strided casting copies are slow: widen once
                np.copyto(g, xs, casting="unsafe")
            src = g if read_interleaved or widen else xs
            _swap(src, t, kind)                    # t = m * swap(x): the partner terms
            t *= mb
            np.multiply(src, cb, out=g)            # g = c * x
            if not in_place:
                ob[..., :start] = xb[..., :start]
                ob[..., end:] = xb[..., end:]
            os_ = ob[..., start:end]
            if write_interleaved:                  # grad mode 3: half math, written interleaved
                np.add(g[..., :h], t[..., :h], out=os_[..., 0::2], dtype=cdt, casting="unsafe")
                np.add(g[..., h:], t[..., h:], out=os_[..., 1::2], dtype=cdt, casting="unsafe")
            else:
                np.add(g, t, out=os_, dtype=cdt, casting="unsafe")

    parallel_for(run_blocks, blocks)
    return out
