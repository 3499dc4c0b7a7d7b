"""Run independent blocks of a kernel on a few threads (NumPy releases the GIL in its loops)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .._threads import num_threads

__all__ = ["num_threads", "parallel_for"]

T = TypeVar("T")
MIN_BLOCKS_PER_THREAD = 4
"""Below this much work per thread, the hand-off costs more than it saves."""

_pool: ThreadPoolExecutor | None = None


def parallel_for(work: Callable[[list[T]], None], items: Sequence[T]) -> None:
    """Call ``work`` on contiguous chunks of ``items``, one chunk per thread; re-raise the first error."""
    global _pool
    threads = min(num_threads(), len(items) // MIN_BLOCKS_PER_THREAD)
    if threads <= 1:
        work(list(items))
        return
    if _pool is None or _pool._max_workers < threads:
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="geir")
    size = -(-len(items) // threads)
    futures = [_pool.submit(work, list(items[i : i + size])) for i in range(0, len(items), size)]
    for future in futures:
        future.result()
