"""The native kernels have no limit the schemas do not state (issue 23, item 16): a rotary slice of any length."""

from __future__ import annotations

import ctypes

import pytest

import geir
from geir.runtimes.onnxruntime import native_library
from helpers import ROPE, ROPE_GRAD, random_feeds, rotary_graph
from native_helpers import requires_compiler
from oracles.numerics import bits_equal

pytestmark = requires_compiler


def _calls() -> int:
    counter = ctypes.CDLL(native_library()).geir_native_calls
    counter.restype = ctypes.c_long
    return counter()


# ---- item 16: a rotary slice of any length -----------------------------------------------------------------------

@pytest.mark.parametrize("op", [ROPE, ROPE_GRAD])
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("dtype, length", [("float32", 2052), ("bfloat16", 2048), ("float16", 2052)])
def test_a_rotary_slice_over_1024_runs_natively_and_bit_identically(op, mode, dtype, length):
    """The schema sets no maximum slice (D <= 1024 is a device rule), so the native kernel takes any length, with
    the same bits as the NumPy kernel: 2048 takes the in-register 16-bit path (modes 0-2), 2052 the row buffers."""
    g = rotary_graph(op, (2, 3, 2, length + 9), (1, 3, 1, length), dtype, rotary_mode=mode,
                     partial_slice=[5, 5 + length])
    feeds = random_feeds(g, seed=mode)
    before = _calls()
    theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert _calls() > before                     # the native kernel ran, not the function body
    assert bits_equal(theirs, geir.run(g, feeds)["y"])


def test_a_failed_rotary_allocation_is_an_error_not_zeros():
    """The tables (allocation 0) and a task's rows (1) now live on the heap: failing either is an ExecutionError
    naming the op, and the next run is right."""
    g = rotary_graph(ROPE, (1, 2, 2, 40), (1, 2, 1, 32), "float16", rotary_mode=0, partial_slice=[4, 36])
    feeds = random_feeds(g, seed=2)
    want = geir.run(g, feeds)["y"]
    library = ctypes.CDLL(native_library())
    library.geir_fail_allocation.argtypes = [ctypes.c_long]
    for fail_at in (0, 1):
        library.geir_fail_allocation(fail_at)
        try:
            with pytest.raises(geir.ExecutionError, match=r"InplacePartialRotaryMul \(geir native kernel\): out of memory"):
                geir.run(g, feeds, runtime="onnxruntime")
        finally:
            library.geir_fail_allocation(-1)
        assert bits_equal(geir.run(g, feeds, runtime="onnxruntime")["y"], want)


