"""Float64 reference of the rotary ops, transcribed from the spec's pseudo-code (spec 2.4).

Deliberately unlike the kernels: explicit pair index arrays and fancy indexing, no blocking,
no swap tables, no intermediate rounding.
"""

from __future__ import annotations

import numpy as np


def pair_indices(mode: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The (a, b) position pairs of a slice of ``length`` in each mode."""
    if mode in (0, 3):
        a = np.arange(length // 2)
        return a, a + length // 2
    if mode == 1:
        a = np.arange(0, length, 2)
        return a, a + 1
    q = length // 4
    i = np.arange(q)
    return np.concatenate([i, 2 * q + i]), np.concatenate([q + i, 3 * q + i])


def rotary_reference(x, cos, sin, mode: int, start: int, end: int, is_grad: bool):
    """Return ``(result, magnitude)`` in float64.

    ``magnitude`` is the sum of the absolute values of the two products forming each
    element (zero outside the slice): the scale against which float32 error is measured.
    """
    out = np.asarray(x, np.float64).copy()
    mag = np.zeros_like(out)
    length = end - start
    if length == 0:
        return out, mag
    g = out[..., start:end].copy()
    c = np.broadcast_to(np.asarray(cos, np.float64), g.shape)
    n = np.broadcast_to(np.asarray(sin, np.float64), g.shape)
    a, b = pair_indices(mode, length)
    y = np.empty_like(g)
    m = np.empty_like(g)
    if not is_grad:
        if mode == 3:
            g = np.concatenate([g[..., 0::2], g[..., 1::2]], -1)
        y[..., a] = c[..., a] * g[..., a] - n[..., a] * g[..., b]
        y[..., b] = c[..., b] * g[..., b] + n[..., b] * g[..., a]
        m[..., a] = abs(c[..., a] * g[..., a]) + abs(n[..., a] * g[..., b])
        m[..., b] = abs(c[..., b] * g[..., b]) + abs(n[..., b] * g[..., a])
    else:
        y[..., a] = c[..., a] * g[..., a] + n[..., b] * g[..., b]
        y[..., b] = c[..., b] * g[..., b] - n[..., a] * g[..., a]
        m[..., a] = abs(c[..., a] * g[..., a]) + abs(n[..., b] * g[..., b])
        m[..., b] = abs(c[..., b] * g[..., b]) + abs(n[..., a] * g[..., a])
        if mode == 3:
            h = length // 2
            t = np.empty_like(y)
            t[..., 0::2], t[..., 1::2] = y[..., :h], y[..., h:]
            y = t
            t = np.empty_like(m)
            t[..., 0::2], t[..., 1::2] = m[..., :h], m[..., h:]
            m = t
    out[..., start:end] = y
    mag[..., start:end] = m
    return out, mag
