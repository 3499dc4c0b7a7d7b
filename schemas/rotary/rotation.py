"""The rotary ops' semantics on the slice (spec 2.4), stated once as tables and as executable code.

Every mode pairs the positions of the slice ``[0, L)``: each position ``i`` has a rotation
``partner[i]`` and a ``sign[i]`` (+1 on the first element of its pair, -1 on the second); mode 3
pairs like mode 0 but reads (forward) or writes (grad) the interleaved layout, given by
``layout``: half-layout position ``i`` lives at ``layout[i]`` of the tensor. The forward is

    g = x[layout];  y = c * g - sign * n * g[partner]

and the grad, its adjoint, is

    y = c * g + sign * n[partner] * g[partner];  out[layout] = y     (g = dy)

``rotate`` executes exactly that in float32 with gathers. The NumPy kernel (pair views), the ONNX
body (integer index arithmetic) and the C kernel (per-mode loops) are tested bit for bit against
it, and the C kernel's tables against ``rotation_tables``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .schema import slice_bounds

__all__ = ["RotationTables", "rotate", "rotation_tables"]


@dataclass(frozen=True)
class RotationTables:
    """The pair structure of one (mode, slice length)."""

    partner: np.ndarray   # int64 (L,): the position each position rotates with
    sign: np.ndarray      # float32 (L,): +1 first of its pair, -1 second
    layout: np.ndarray    # int64 (L,): where half-layout position i lives (identity except mode 3)


def rotation_tables(mode: int, length: int) -> RotationTables:
    """The tables of ``rotary_mode`` on a slice of ``length`` (a multiple of 2, of 4 for mode 2)."""
    i = np.arange(length, dtype=np.int64)
    half, quarter = length // 2, length // 4
    layout = i
    if mode == 1:                                    # pairs (2k, 2k + 1)
        partner, first = i ^ 1, i % 2 == 0
    elif mode == 2:                                  # pairs (k, k + q) inside each half
        within = i % max(half, 1)
        partner, first = i - within + (within + quarter) % max(half, 1), within < quarter
    else:                                            # modes 0 and 3: pairs (k, k + L/2)
        partner, first = (i + half) % max(length, 1), i < half
        if mode == 3:                                # half position k at 2k, k + L/2 at 2k + 1
            layout = np.where(first, 2 * i, 2 * (i - half) + 1)
    return RotationTables(partner, np.where(first, 1.0, -1.0).astype(np.float32), layout)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_mode: int, partial_slice: Sequence[int],
           *, grad: bool) -> np.ndarray:
    """The op's result, computed from the tables: float32 math, one rounding to ``x``'s dtype."""
    start, end = slice_bounds(partial_slice, x.shape[-1])
    out = x.copy()
    if end == start or x.size == 0 or cos.size == 0 or sin.size == 0:   # the identity (grad_is_noop; the forward's
        return out                                                      # empty cos/sin need L = 0, RP-S6)
    t = rotation_tables(rotary_mode, end - start)
    g = x[..., start:end].astype(np.float32)
    c, n = cos.astype(np.float32), sin.astype(np.float32)
    if grad:
        y = c * g + (t.sign * n[..., t.partner]) * g[..., t.partner]
        result = np.empty_like(y)
        result[..., t.layout] = y
    else:
        g = g[..., t.layout]
        result = c * g + (-t.sign * n) * g[..., t.partner]
    out[..., start:end] = result.astype(x.dtype)
    return out
