"""Caller-provided output buffers: written in place on both runtimes, checked with one set of errors."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from helpers import random_feeds
from moe.helpers import moe_grad_graph
from oracles.numerics import bits_equal
from rotary.helpers import ROPE_GRAD, rotary_graph
from sparse_attention.helpers import AttentionCase, sfa_graph

RUNTIMES = geir.runtimes.runtime_names()


def _buffers_for(results: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.zeros_like(array) for name, array in results.items()}


def _graphs():
    rope = rotary_graph(ROPE_GRAD, (2, 3, 2, 16), (1, 3, 1, 8), "bfloat16", rotary_mode=1, partial_slice=[4, 12])
    moe = moe_grad_graph((8, 32), (4, 32), 8, (4, 2), "float16", "float32")
    moe_feeds = random_feeds(moe, seed=1)
    moe_feeds["indices"] = np.random.default_rng(0).permutation(8).astype(np.int32)
    case = AttentionCase(mode=3, seed=2)
    sfa, sfa_feeds = sfa_graph(case.arrays(), scale_value=case.scale, return_softmax_lse=True)
    return [("rotary", rope, random_feeds(rope, seed=3)), ("moe grad", moe, moe_feeds), ("sfa", sfa, sfa_feeds)]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("index", range(3), ids=["rotary", "moe grad", "sfa"])
def test_buffers_are_written_and_returned_and_reusable(runtime, index):
    _, graph, feeds = _graphs()[index]
    executable = geir.runtimes.get_runtime(runtime).compile(graph)
    want = executable.run(feeds)
    buffers = _buffers_for(want)
    snapshot = {k: v.copy() for k, v in feeds.items()}
    for _ in range(2):                                        # a loop that reuses its buffers
        got = executable.run(feeds, outputs=buffers)
        assert all(got[name] is buffers[name] for name in buffers)
        assert all(bits_equal(got[name], want[name]) for name in want)
    assert all(np.array_equal(snapshot[k], feeds[k]) for k in feeds)
    partial = {next(iter(want)): np.empty_like(next(iter(want.values())))}   # some outputs only
    got = geir.run(graph, feeds, runtime, outputs=partial)
    assert set(got) == set(want) and got[next(iter(want))] is partial[next(iter(want))]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_in_place_op_may_overwrite_its_only_reader_feed(runtime):
    graph = rotary_graph(ROPE_GRAD, (2, 3, 2, 16), (1, 3, 1, 8), "float32", rotary_mode=1, partial_slice=[0, 8])
    feeds = random_feeds(graph, seed=4)
    want = geir.run(graph, feeds, runtime)["y"]
    x = feeds["x"].copy()
    got = geir.run(graph, {**feeds, "x": x}, runtime, outputs={"y": x})["y"]
    assert got is x and bits_equal(x, want)


BAD_BUFFERS = [
    (lambda f: {"z": np.zeros((2, 3, 2, 16), np.float32)}, r"outputs: 'z' is not a graph output \(outputs: y\)"),
    (lambda f: {"y": np.zeros((2, 3, 2, 16), np.float16)}, r"output buffer 'y': expected dtype float32, got float16"),
    (lambda f: {"y": np.zeros((1, 3, 2, 16), np.float32)},
     r"output buffer 'y': expected shape \[2, 3, 2, 16\], got \[1, 3, 2, 16\]"),
    (lambda f: {"y": np.zeros((2, 3, 2, 32), np.float32)[..., ::2]}, "expected a writeable C-contiguous array"),
    (lambda f: {"y": f["x"][...]}, "shares memory with feed 'x'"),     # a view of the feed, not the feed itself
    (lambda f: {"y": [1, 2]}, "output buffer 'y': expected a NumPy array, got list"),
]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("make, message", BAD_BUFFERS)
def test_bad_buffers_are_refused_naming_the_output(runtime, make, message):
    graph = rotary_graph(ROPE_GRAD, (2, 3, 2, 16), (1, 3, 1, 8), "float32", rotary_mode=1, partial_slice=[0, 8])
    feeds = random_feeds(graph, seed=5)
    snapshot = feeds["x"].copy()
    with pytest.raises(geir.ExecutionError, match=message):
        geir.run(graph, feeds, runtime, outputs=make(feeds))
    assert np.array_equal(feeds["x"], snapshot)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_read_only_buffers_and_non_mappings_are_refused(runtime):
    graph = rotary_graph(ROPE_GRAD, (2, 3, 2, 16), (1, 3, 1, 8), "float32", rotary_mode=1, partial_slice=[0, 8])
    feeds = random_feeds(graph, seed=5)
    readonly = np.zeros((2, 3, 2, 16), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(geir.ExecutionError, match="output buffer 'y': expected a writeable C-contiguous array"):
        geir.run(graph, feeds, runtime, outputs={"y": readonly})
    with pytest.raises(geir.ExecutionError, match="outputs: expected a mapping of output name -> array, got list"):
        geir.run(graph, feeds, runtime, outputs=[readonly])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_feed_read_by_two_nodes_is_not_an_output_buffer_and_buffers_do_not_overlap(runtime):
    b = geir.GraphBuilder("two_readers")
    x = b.input("x", "float32", (1, 2, 1, 8))
    c = b.input("c", "float32", (1, 2, 1, 8))
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 8], name="a"), "y1")
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 8], name="b"), "y2")
    graph = b.build()
    feeds = random_feeds(graph, seed=6)
    with pytest.raises(geir.ExecutionError, match="output buffer 'y1': shares memory with feed 'x'; only the feed an "
                                                  "in-place op overwrites"):
        geir.run(graph, feeds, runtime, outputs={"y1": feeds["x"]})
    shared = np.empty((2, 1, 2, 1, 8), np.float32)
    with pytest.raises(geir.ExecutionError, match="output buffer 'y2': shares memory with the buffer of output 'y1'"):
        geir.run(graph, feeds, runtime, outputs={"y1": shared[0], "y2": shared[0]})


@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("op", ["forward", "grad"])
def test_numpy_moe_kernels_write_the_callers_buffers_themselves(op, with_probs):
    """The NumPy MoE kernels take ``outputs=``: with caller buffers a run allocates only its block temporaries,
    not a second copy of the output (that copy made caller buffers slower than fresh outputs)."""
    import tracemalloc

    from moe.helpers import moe_graph

    tokens, topk, hidden = 4096, 4, 1024                      # outputs of 64 MiB (grad) and 16 MiB (forward)
    probs = (tokens, topk) if with_probs else None
    if op == "grad":
        graph = moe_grad_graph((tokens * topk, hidden) if with_probs else None, (tokens if with_probs else tokens * topk,
                               hidden), tokens * topk, probs)
    else:
        graph = moe_graph(tokens * topk, hidden, tokens * topk, probs)
    feeds = random_feeds(graph, seed=4)
    feeds["indices"] = np.random.default_rng(1).permutation(tokens * topk).astype(np.int32)
    executable = geir.runtimes.get_runtime("numpy").compile(graph)
    want = executable.run(feeds)
    buffers = _buffers_for(want)
    largest = max(a.nbytes for a in want.values())
    tracemalloc.start()
    try:
        got = executable.run(feeds, outputs=buffers)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(got[name] is buffers[name] and bits_equal(got[name], want[name]) for name in want)
    assert peak < largest / 2, f"a run with buffers allocated {peak} bytes (the largest output has {largest})"


def _add_constant_graph() -> geir.Graph:
    b = geir.GraphBuilder("plus_w")
    x = b.input("x", "float32", (2, 3))
    w = b.constant("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    b.output(b.op("Add", x, w), "y")
    return b.build()


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("view", ["itself", "a view"])
def test_a_graph_constant_is_never_an_output_buffer(runtime, view):
    """Issue 23 item 9: the run wrote y into the constant w, so the graph changed and the next runs disagreed."""
    graph = _add_constant_graph()
    w = graph.constants["w"]
    snapshot = w.copy()
    feeds = {"x": np.ones((2, 3), np.float32)}
    buffer = w if view == "itself" else w.reshape(2, 3)[...]
    with pytest.raises(geir.ExecutionError, match="output buffer 'y': shares memory with graph constant 'w'"):
        geir.run(graph, feeds, runtime, outputs={"y": buffer})
    assert np.array_equal(graph.constants["w"], snapshot)
    for name in RUNTIMES:    # the graph still means what it said, on both runtimes
        np.testing.assert_array_equal(geir.run(graph, feeds, name)["y"], snapshot + 1)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_memory_of_a_feed_of_another_byte_order_is_not_an_output_buffer(runtime):
    """A big-endian feed is read from a native copy; a buffer over the caller's array would still overwrite it."""
    graph = _add_constant_graph()
    x = np.ones((2, 3), ">f4")
    snapshot = x.copy()
    buffer = x.view(np.uint8).view(np.float32)     # the same bytes, seen as native float32
    with pytest.raises(geir.ExecutionError, match="output buffer 'y': shares memory with feed 'x'"):
        geir.run(graph, {"x": x}, runtime, outputs={"y": buffer})
    assert np.array_equal(x, snapshot)
