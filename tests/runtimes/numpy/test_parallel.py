"""The NumPy runtime's thread fan-out: chunks, errors, and BLAS held to one thread while it runs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from geir.runtimes.numpy import _parallel


def _blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setattr(_parallel, "num_threads", lambda: 2)


def test_chunks_cover_the_items_in_order_once(two_threads):
    seen: list[list[int]] = []
    lock = threading.Lock()

    def work(chunk: list[int]) -> None:
        with lock:
            seen.append(chunk)

    _parallel.parallel_for(work, list(range(11)))
    assert sorted(seen) == [list(range(6)), list(range(6, 11))]


def test_the_first_error_of_a_worker_reaches_the_caller(two_threads):
    def work(chunk: list[int]) -> None:
        if 7 in chunk:
            raise ValueError("bad block 7")

    with pytest.raises(ValueError, match="bad block 7"):
        _parallel.parallel_for(work, list(range(12)))


@pytest.mark.skipif(not _blas_threads(), reason="threadpoolctl finds no BLAS library in this NumPy")
def test_blas_runs_single_threaded_inside_a_parallel_run_and_is_restored(two_threads):
    before = _blas_threads()
    inside: list[list[int]] = []

    def work(chunk: list[int]) -> None:
        inside.append(_blas_threads())
        np.ones((4, 4)) @ np.ones((4, 4))

    _parallel.parallel_for(work, list(range(8)))
    assert inside and all(threads == [1] * len(before) for threads in inside)
    assert _blas_threads() == before


@pytest.mark.skipif(not _blas_threads(), reason="threadpoolctl finds no BLAS library in this NumPy")
def test_a_single_threaded_run_leaves_blas_alone(monkeypatch):
    monkeypatch.setattr(_parallel, "num_threads", lambda: 1)
    before = _blas_threads()
    inside: list[list[int]] = []
    _parallel.parallel_for(lambda chunk: inside.append(_blas_threads()), list(range(8)))
    assert inside == [before]


@pytest.mark.skipif(not _blas_threads(), reason="threadpoolctl finds no BLAS library in this NumPy")
def test_overlapping_parallel_runs_restore_blas_only_when_the_last_one_ends():
    """A second user thread's run that starts and ends inside the first must not lift the limit under it."""
    before = _blas_threads()
    seen_by_second: list[list[int]] = []

    def second_run() -> None:
        with _parallel._blas_single_threaded():
            seen_by_second.append(_blas_threads())

    with _parallel._blas_single_threaded():
        runner = threading.Thread(target=second_run)
        runner.start()
        runner.join(10)
        still_limited = _blas_threads()
    assert seen_by_second == [[1] * len(before)]
    assert still_limited == [1] * len(before)
    assert _blas_threads() == before


def test_a_blas_that_cannot_be_limited_does_not_fail_the_run(two_threads, monkeypatch):
    class Broken:
        def limit(self, **_):
            raise OSError("no such symbol")

    monkeypatch.setattr(_parallel, "_controller", Broken())
    done: list[int] = []
    _parallel.parallel_for(lambda chunk: done.extend(chunk), list(range(8)))
    assert sorted(done) == list(range(8))
