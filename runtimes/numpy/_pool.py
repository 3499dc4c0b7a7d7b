"""Large kernel outputs from memory that earlier runs let go of: the NumPy runtime's arena.

A fresh output of a memory-bound op costs its page faults on first touch, and on this kind of VM they
cost more than the op: the NumPy rotary grad at [4, 2048, 32, 128] float32 took 58 ms into new arrays
against 31 ms into buffers already touched. ONNX Runtime hands out outputs from its arena; this module
does the same for the NumPy kernels. ``empty`` gives a plain ``numpy.ndarray``; when the last array that
views its memory is gone (a ``weakref.finalize`` on the buffer NumPy keeps), the memory goes back to a
short list that the next ``empty`` of about that size takes from. Memory still viewed by any array is
never handed out again, so an output a caller keeps is never overwritten.

Bounded: only buffers of at least ``MIN_BYTES``, at most ``MAX_KEPT`` of them and ``MAX_KEPT_BYTES`` in
all are kept (the oldest go first), and a request takes a kept buffer at most twice its size.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

__all__ = ["MAX_KEPT", "MAX_KEPT_BYTES", "MIN_BYTES", "empty", "kept_bytes"]

MIN_BYTES = 1 << 20
"""Smaller arrays come from NumPy's allocator, which already reuses them."""
MAX_KEPT = 8
MAX_KEPT_BYTES = 1 << 30
GRANULE = 1 << 21
"""Kept buffers are whole multiples of a huge page, so that nearby sizes share them."""

_lock = threading.RLock()   # re-entrant: a finalizer may run inside ``_take`` on the same thread
_kept: list[np.ndarray] = []   # uint8 buffers, oldest first


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array, like ``np.empty``, from kept memory when a fitting buffer is free."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES or dtype.hasobject:
        return np.empty(shape, dtype)
    raw = _take(nbytes)
    if raw is None:
        raw = np.empty(-(-nbytes // GRANULE) * GRANULE, np.uint8)
    flat = np.frombuffer(memoryview(raw), dtype=dtype, count=count)
    keeper = flat.base   # NumPy's own memoryview of raw: every view of the result keeps it alive
    if not isinstance(keeper, memoryview):   # never seen; without it the memory could not be tracked
        return np.empty(shape, dtype)
    finalizer = weakref.finalize(keeper, _give_back, raw)
    finalizer.atexit = False
    return flat.reshape(shape)


def kept_bytes() -> int:
    """Bytes held for reuse now (for tests and diagnostics)."""
    with _lock:
        return sum(buffer.nbytes for buffer in _kept)


def _take(nbytes: int) -> np.ndarray | None:
    """The smallest kept buffer that fits, removed from the list (by identity: a finalizer running in
    between may have changed the list; a buffer it evicted meanwhile is just as free)."""
    with _lock:
        fitting = [buffer for buffer in _kept if nbytes <= buffer.nbytes <= 2 * nbytes + GRANULE]
        best = min(fitting, key=lambda buffer: buffer.nbytes, default=None)
        for i, buffer in enumerate(_kept):
            if buffer is best:
                del _kept[i]
                break
        return best


def _give_back(raw: np.ndarray) -> None:
    with _lock:
        _kept.append(raw)
        total = sum(buffer.nbytes for buffer in _kept)
        while _kept and (len(_kept) > MAX_KEPT or total > MAX_KEPT_BYTES):
            total -= _kept.pop(0).nbytes
