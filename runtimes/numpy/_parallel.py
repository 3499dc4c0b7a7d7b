"""Run independent blocks of a kernel on a few threads (NumPy releases the GIL in its loops).

While the blocks run on more than one thread, the BLAS library NumPy's matmul calls is held to one
thread of its own: each of our threads calling a BLAS that threads every product again puts two
threads on each CPU, and the products slow down more than the threads gain (the NumPy attention
forward at the CANN-sized shape: 0.77 s with both kinds of threads against 0.43 s with BLAS held
to one). A single-threaded run leaves BLAS as it is, so a big product still uses every CPU.
threadpoolctl lets one Python thread at a time set OpenBLAS's limit (the first that does, while it
lives): runs started from another thread then keep BLAS's threads (slower; and as BLAS splits a
product differently with another thread count, float32 sums may round differently, as they would
under another ``OPENBLAS_NUM_THREADS``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from threadpoolctl import ThreadpoolController

from .._threads import num_threads

__all__ = ["num_threads", "parallel_for"]

T = TypeVar("T")
MIN_BLOCKS_PER_THREAD = 4
"""Below this much work per thread, the hand-off costs more than it saves."""

_pool: ThreadPoolExecutor | None = None
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limit: object | None = None   # threadpoolctl's limiter while any parallel run is in flight
_controller: ThreadpoolController | None = None


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
    with _blas_single_threaded():
        futures = [_pool.submit(work, list(items[i : i + size])) for i in range(0, len(items), size)]
        for future in futures:
            future.result()


@contextmanager
def _blas_single_threaded() -> Iterator[None]:
    """Hold BLAS to one thread while at least one parallel run is in flight (runs may overlap: counted)."""
    global _blas_users, _blas_limit, _controller
    with _blas_lock:
        if _blas_users == 0:
            try:
                _controller = _controller or ThreadpoolController()
                _blas_limit = _controller.limit(limits=1, user_api="blas")
            except Exception:   # a BLAS threadpoolctl cannot drive: run as before, only slower
                _blas_limit = None
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0 and _blas_limit is not None:
                _blas_limit.restore_original_limits()
                _blas_limit = None
