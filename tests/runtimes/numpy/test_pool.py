"""The NumPy runtime's output arena: memory comes back only when no array views it, within its bounds."""

from __future__ import annotations

import gc
import threading

import ml_dtypes
import numpy as np
import pytest

import geir
from geir.runtimes.numpy import _pool as pool

BIG = (1024, 1024)   # 4 MiB of float32: above MIN_BYTES


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch):
    monkeypatch.setattr(pool, "_kept", [])
    yield
    gc.collect()


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_memory_comes_back_when_the_last_view_is_gone():
    first = pool.empty(BIG, np.float32)
    where = address(first)
    view = first[::2, 3:]
    del first
    assert pool.kept_bytes() == 0                     # the view still reads it
    other = pool.empty(BIG, np.float32)
    assert not np.shares_memory(other, view) and address(other) != where
    del view
    assert pool.kept_bytes() >= 4 << 20
    again = pool.empty(BIG, np.float32)
    assert address(again) == where and pool.kept_bytes() == 0


def test_a_kept_output_is_never_overwritten_by_later_arrays():
    kept = pool.empty(BIG, np.float32)
    kept[...] = 7.0
    for _ in range(5):
        scratch = pool.empty(BIG, np.float32)
        scratch[...] = -1.0
        del scratch
    assert (kept == 7.0).all()


def test_small_and_object_arrays_come_from_numpy():
    small = pool.empty((8, 8), np.float32)
    assert small.flags.owndata and small.shape == (8, 8)
    objects = pool.empty((1 << 18,), np.dtype(object))
    assert objects.flags.owndata


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int32])
def test_shapes_and_dtypes_are_what_was_asked(dtype):
    a = pool.empty((3, 512, 1024), dtype)
    assert a.shape == (3, 512, 1024) and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable


def test_a_request_takes_only_a_buffer_near_its_size():
    huge = pool.empty((64 << 20,), np.uint8)
    del huge
    small = pool.empty((1 << 20,), np.uint8)          # a 64 MiB buffer is not spent on 1 MiB
    assert pool.kept_bytes() >= 64 << 20
    del small


def test_bounds_on_what_is_kept(monkeypatch):
    monkeypatch.setattr(pool, "MAX_KEPT", 3)
    monkeypatch.setattr(pool, "MAX_KEPT_BYTES", 20 << 20)
    arrays = [pool.empty((k << 20,), np.uint8) for k in (2, 4, 6, 8, 10)]
    while arrays:
        arrays.pop(0)                                   # given back in this order: 2, 4, 6, 8, 10 MiB
    assert len(pool._kept) <= 3 and pool.kept_bytes() <= 20 << 20
    assert [b.nbytes >> 20 for b in pool._kept] == [8, 10]   # the oldest went first


def test_threads_taking_and_returning_memory_keep_their_own_data():
    errors: list[str] = []

    def work(seed: int) -> None:
        for i in range(40):
            a = pool.empty((1 << 18, 2 + i % 3), np.float32)
            a[...] = seed * 1000 + i
            if not (a == seed * 1000 + i).all():
                errors.append(f"thread {seed} step {i}: another thread wrote this memory")
            del a

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


def test_runs_reuse_the_memory_of_dropped_outputs_and_stay_correct():
    shape = (2, 256, 16, 128)
    rng = np.random.default_rng(0)
    dy = rng.standard_normal(shape).astype(np.float32)
    cos = rng.standard_normal((1, 256, 1, 128)).astype(np.float32)
    sin = rng.standard_normal((1, 256, 1, 128)).astype(np.float32)
    b = geir.GraphBuilder("rope")
    x = b.InplacePartialRotaryMulGrad(b.input("dy", "float32", shape), b.input("cos", "float32", cos.shape),
                                      b.input("sin", "float32", sin.shape), rotary_mode=1, partial_slice=[0, 128])
    b.output(x, "dx")
    executable = geir.runtimes.get_runtime("numpy").compile(b.build())
    feeds = {"dy": dy, "cos": cos, "sin": sin}
    first = executable.run(feeds)["dx"]
    expected, where = first.copy(), address(first)
    del first
    second = executable.run(feeds)["dx"]
    assert address(second) == where
    np.testing.assert_array_equal(second, expected)
    kept = second
    third = executable.run(feeds)["dx"]
    assert not np.shares_memory(third, kept)
    np.testing.assert_array_equal(kept, expected)
