"""The NumPy interpreter: feeds, in-place buffer reuse, freeing, run-time re-checks, error wrapping."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import geir
from geir import ExecutionError, GraphError
from geir.runtimes import get_runtime, runtime_names
from geir.runtimes.numpy import KERNELS, NumpyRuntime
from helpers import random_feeds
from oracles.rotary import rotary_reference
from rotary.helpers import ROPE, ROPE_GRAD, rotary_graph


def _chain(dtype="float32", length=3):
    """x -> grad -> grad -> ... (each node rotates the previous result)."""
    b = geir.GraphBuilder("chain")
    x = b.input("x", dtype, ("B", 4, 2, 16))
    c = b.input("cos", dtype, (1, 4, 1, 16))
    s = b.input("sin", dtype, (1, 4, 1, 16))
    y = x
    for i in range(length):
        y = b.InplacePartialRotaryMulGrad(y, c, s, rotary_mode=1, partial_slice=[0, 16], name=f"n{i}")
    b.output(y, "y")
    return b.build()


def test_runtime_registry():
    assert "numpy" in runtime_names() and isinstance(get_runtime("numpy"), NumpyRuntime)
    with pytest.raises(ValueError, match="unknown runtime 'tpu': expected one of .*numpy"):
        geir.run(_chain(), {}, runtime="tpu")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_chain_matches_reference_and_feeds_are_never_modified(dtype):
    g = _chain(dtype)
    rng = np.random.default_rng(1)
    np_dt = geir.as_dtype(dtype).numpy
    feeds = {"x": rng.standard_normal((3, 4, 2, 16)).astype(np_dt),
             "cos": rng.uniform(-1, 1, (1, 4, 1, 16)).astype(np_dt),
             "sin": rng.uniform(-1, 1, (1, 4, 1, 16)).astype(np_dt)}
    before = {k: v.copy() for k, v in feeds.items()}
    out = geir.run(g, feeds)
    for k in feeds:
        assert np.array_equal(feeds[k].view(np.uint8), before[k].view(np.uint8)), k
    expected = feeds["x"]
    for _ in range(3):  # each node rounds once to the dtype, as the graph does
        ref, _ = rotary_reference(expected, feeds["cos"], feeds["sin"], 1, 0, 16, True)
        expected = ref.astype(np.float32).astype(np_dt)
    assert list(out) == ["y"] and out["y"].dtype == np_dt
    np.testing.assert_allclose(out["y"].astype(np.float64), expected.astype(np.float64), rtol=1e-2, atol=1e-2)


@pytest.fixture
def reuse_log(monkeypatch):
    """Records, for each rotary-grad call, whether the runtime passed the input buffer as ``out``."""
    seen: list[bool] = []
    original = KERNELS[("ai.cann", ROPE_GRAD)]

    def spy(dy, cos, sin, *, out=None, **attrs):
        seen.append(out is dy)
        return original(dy, cos, sin, out=out, **attrs)

    monkeypatch.setitem(KERNELS, ("ai.cann", ROPE_GRAD), spy)
    return seen


def test_in_place_only_on_owned_buffers_at_their_last_use(reuse_log):
    seen = reuse_log
    g = _chain(length=3)
    geir.run(g, random_feeds(g, bindings={"B": 2}))
    assert seen == [False, True, True]  # the feed is never written; intermediates are reused


def test_no_reuse_when_the_value_is_read_later_or_is_an_output(reuse_log):
    seen = reuse_log
    b = geir.GraphBuilder("fan")
    x = b.input("x", "float32", (1, 4, 2, 16))
    c = b.input("c", "float32", (1, 4, 1, 16))
    y = b.InplacePartialRotaryMulGrad(x, c, c, partial_slice=[0, 16], name="a")
    z1 = b.InplacePartialRotaryMulGrad(y, c, c, partial_slice=[0, 16], name="b")
    z2 = b.InplacePartialRotaryMulGrad(y, c, c, partial_slice=[0, 16], name="c")
    b.output(y, "y")
    b.output(z1, "z1")
    b.output(z2, "z2")
    g = b.build()
    feeds = {"x": np.ones((1, 4, 2, 16), np.float32), "c": np.full((1, 4, 1, 16), 0.5, np.float32)}
    out = geir.run(g, feeds)
    assert seen == [False, False, False]  # y is a graph output: never overwritten
    np.testing.assert_array_equal(out["z1"], out["z2"])
    np.testing.assert_array_equal(out["y"], geir.run(g, feeds)["y"])


def test_values_are_freed_after_their_last_use(monkeypatch):
    import weakref

    results, alive_at_call = [], []
    original = KERNELS[("ai.cann", ROPE_GRAD)]

    def spy(dy, cos, sin, *, out=None, **attrs):  # never reuses, so every node's result is its own array
        alive_at_call.append([r() is not None for r in results])
        result = original(dy, cos, sin, **attrs)
        results.append(weakref.ref(result))
        return result

    monkeypatch.setitem(KERNELS, ("ai.cann", ROPE_GRAD), spy)
    g = _chain(length=4)
    geir.run(g, random_feeds(g, bindings={"B": 2}))
    # when node i runs, only node i-1's result (its input) is still alive
    assert alive_at_call == [[], [True], [False, True], [False, False, True]]


def test_dead_nodes_are_not_executed(monkeypatch):
    calls = []
    original = KERNELS[("ai.cann", ROPE_GRAD)]
    monkeypatch.setitem(KERNELS, ("ai.cann", ROPE_GRAD), lambda *a, **k: calls.append(1) or original(*a, **k))
    b = geir.GraphBuilder("dead")
    x = b.input("x", "float32", (1, 4, 2, 16))
    c = b.input("c", "float32", (1, 4, 1, 16))
    b.InplacePartialRotaryMulGrad(x, c, c, partial_slice=[0, 16], name="unused")
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, partial_slice=[0, 16], name="used"), "y")
    exe = NumpyRuntime().compile(b.build())
    assert [n.name for n in exe.order] == ["used"]
    exe.run({"x": np.ones((1, 4, 2, 16), np.float32), "c": np.ones((1, 4, 1, 16), np.float32)})
    assert len(calls) == 1


@pytest.mark.parametrize("feeds, pattern", [
    ({"cos": 1, "sin": 1}, r"input 'x' \(float32\[B,4,2,16\]\) is not fed"),
    ({"x": 1, "cos": 1, "sin": 1, "extra": 1}, r"unexpected feed\(s\) \['extra'\]"),
    ({"x": np.zeros((2, 4, 2, 16)), "cos": 1, "sin": 1}, r"input 'x': expected dtype float32, got float64; cast"),
    ({"x": np.zeros((2, 4, 16), np.float32), "cos": 1, "sin": 1}, r"input 'x': expected rank 4 \['B', 4, 2, 16\], got rank 3"),
    ({"x": np.zeros((2, 5, 2, 16), np.float32), "cos": 1, "sin": 1}, r"input 'x' dim 1: expected 4, got 5"),
    ({"x": np.zeros((2, 4, 2, 16), ml_dtypes.bfloat16), "cos": 1, "sin": 1}, r"expected dtype float32, got bfloat16"),
])
def test_feed_validation(feeds, pattern):
    g = _chain()
    good = {"x": np.zeros((2, 4, 2, 16), np.float32), "cos": np.zeros((1, 4, 1, 16), np.float32),
            "sin": np.zeros((1, 4, 1, 16), np.float32)}
    feeds = {k: (good.get(k, np.zeros(1, np.float32)) if isinstance(v, int) else v) for k, v in feeds.items()}
    with pytest.raises(ExecutionError, match=pattern):
        geir.run(g, feeds)


def test_inconsistent_symbol_bindings():
    b = geir.GraphBuilder("sym")
    x = b.input("x", "float32", ("B", "S", 2, 16))
    c = b.input("c", "float32", ("B", "S", 1, 16))
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, partial_slice=[0, 16]), "y")
    g = b.build()
    with pytest.raises(ExecutionError, match=r"input 'c' dim 1: symbol 'S' is 3 here but 4 in input 'x' dim 1"):
        geir.run(g, {"x": np.zeros((2, 4, 2, 16), np.float32), "c": np.zeros((2, 3, 1, 16), np.float32)})
    with pytest.raises(ExecutionError, match=r"input 'c' dim 0: symbol 'B' is 1 here but 2 in input 'x' dim 0"):
        geir.run(g, {"x": np.zeros((2, 4, 2, 16), np.float32), "c": np.zeros((1, 4, 1, 16), np.float32)})
    out = geir.run(g, {"x": np.ones((2, 4, 2, 16), np.float32), "c": np.zeros((2, 4, 1, 16), np.float32)})
    assert out["y"].shape == (2, 4, 2, 16) and not out["y"].any()


def test_deferred_rules_are_checked_on_fed_shapes():
    g = rotary_graph(ROPE_GRAD, ("B", "S", "N", "D"), (1, 1, 1, 32), rotary_mode=1, partial_slice=[16, 48])
    ok = {"x": np.zeros((1, 2, 2, 48), np.float32), "cos": np.zeros((1, 1, 1, 32), np.float32),
          "sin": np.zeros((1, 1, 1, 32), np.float32)}
    assert geir.run(g, ok)["y"].shape == (1, 2, 2, 48)
    bad = dict(ok, x=np.zeros((1, 2, 2, 40), np.float32))
    with pytest.raises(ExecutionError, match=r"\[RP-S5\] InplacePartialRotaryMulGrad 'node': attribute 'partial_slice': "
                                             r"expected 0 <= start <= end <= D = 40, got start=16, end=48 \(on the fed shapes"):
        geir.run(g, bad)
    empty = dict(ok, x=np.zeros((1, 0, 2, 48), np.float32))   # the grad of an empty dy is the identity (issue 27)
    assert geir.run(g, empty)["y"].shape == (1, 0, 2, 48)
    f = rotary_graph(ROPE, ("B", "S", "N", "D"), (1, 1, 1, 32), rotary_mode=1, partial_slice=[16, 48])
    with pytest.raises(ExecutionError, match=r"\[RP-S6\] .*input 0 'x' dim 1: expected a non-zero extent, got 0"):
        geir.run(f, empty)                                    # the forward still refuses it on the fed shapes


def test_kernel_failures_name_the_node(monkeypatch):
    def broken(*args, **kwargs):
        raise IndexError("index 9 is out of bounds")

    monkeypatch.setitem(KERNELS, ("ai.cann", ROPE), broken)
    g = rotary_graph(ROPE, (1, 1, 1, 8), (1, 1, 1, 8), partial_slice=[0, 8], name="rope_fwd")
    with pytest.raises(ExecutionError, match=r"While executing InplacePartialRotaryMul 'rope_fwd' \(built at helpers.py:\d+ "
                                             r"in rotary_graph\): IndexError: index 9 is out of bounds") as err:
        geir.run(g, random_feeds(g))
    assert err.value.node == "rope_fwd" and isinstance(err.value.__cause__, IndexError)


def test_kernel_returning_the_wrong_type_is_caught(monkeypatch):
    monkeypatch.setitem(KERNELS, ("ai.cann", ROPE), lambda x, cos, sin, **kw: x.astype(np.float64))
    g = rotary_graph(ROPE, (1, 1, 1, 8), (1, 1, 1, 8), partial_slice=[0, 8])
    with pytest.raises(ExecutionError, match=r"kernel returned float64\[1, 1, 1, 8\] for output 'y', expected float32\[1,1,1,8\]"):
        geir.run(g, random_feeds(g))


def test_unbuilt_graph_and_missing_kernel_are_graph_errors(monkeypatch):
    from geir import Graph
    with pytest.raises(GraphError, match="is not built"):
        NumpyRuntime().compile(Graph("raw"))
    g = rotary_graph(ROPE, (1, 1, 1, 8), (1, 1, 1, 8), partial_slice=[0, 8])
    monkeypatch.delitem(KERNELS, ("ai.cann", ROPE))
    with pytest.raises(GraphError, match="runtime 'numpy' has no kernel for ai.cann::InplacePartialRotaryMul"):
        NumpyRuntime().compile(g)


def test_an_executable_runs_many_times_with_fresh_outputs():
    g = rotary_graph(ROPE_GRAD, ("B", 2, 1, 8), (1, 2, 1, 8), rotary_mode=1, partial_slice=[0, 8])
    exe = NumpyRuntime().compile(g)
    a = exe.run(random_feeds(g, seed=1, bindings={"B": 3}))["y"]
    b = exe.run(random_feeds(g, seed=2, bindings={"B": 5}))["y"]
    assert a.shape == (3, 2, 1, 8) and b.shape == (5, 2, 1, 8) and not np.shares_memory(a, b)
