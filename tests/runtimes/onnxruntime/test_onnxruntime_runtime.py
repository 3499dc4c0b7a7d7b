"""runtime="onnxruntime": parity with the NumPy runtime, data validation of graph inputs, caching."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import geir
from geir import ExecutionError
from geir.runtimes import get_runtime
from helpers import random_feeds
from moe.helpers import moe_grad_graph, moe_graph
from oracles.numerics import assert_within_ulps_of_scale, bits_equal
from rotary.helpers import ROPE, ROPE_GRAD, rotary_graph
from sparse_attention.helpers import SFA, AttentionCase, sfa_graph

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("op", [ROPE, ROPE_GRAD])
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rotary_parity_is_bit_exact(op, mode, dtype):
    g = rotary_graph(op, ("B", 3, 4, 24), (1, 3, 1, 8), dtype, "float32" if op == ROPE and dtype != "float32" else dtype,
                     rotary_mode=mode, partial_slice=[7, 15])
    feeds = random_feeds(g, seed=mode, bindings={"B": 2})
    before = {k: v.copy() for k, v in feeds.items()}
    ours, theirs = geir.run(g, feeds), geir.run(g, feeds, runtime="onnxruntime")
    assert bits_equal(theirs["y"], ours["y"])
    assert all(bits_equal(before[k], feeds[k]) for k in feeds)


@pytest.mark.parametrize("tt, tp", [("float32", "float16"), ("bfloat16", "bfloat16"), ("float16", "float32")])
def test_moe_parity(tt, tp):
    rng = np.random.default_rng(0)
    s = rng.permutation(12).astype(np.int32)
    g = moe_grad_graph((12, 5), (4, 5), 12, (4, 3), tt, tp)
    feeds = {"tokens": rng.standard_normal((12, 5)).astype(DTYPES[tt]), "dy": rng.standard_normal((4, 5)).astype(DTYPES[tt]),
             "indices": s, "probs": rng.uniform(size=(4, 3)).astype(DTYPES[tp])}
    ours, theirs = geir.run(g, feeds), geir.run(g, feeds, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"])
    assert_within_ulps_of_scale(theirs["pg"], ours["pg"].astype(np.float64), DTYPES[tp], ulps=2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sfa_parity(dtype):
    c = AttentionCase(layout="TND", mode=3, bs=2, Dr=4, N2=2, N1=4, sinks=True, dtype=dtype, seed=5)
    a = c.arrays()
    g, feeds = sfa_graph(a, SFA, **c.forward_attrs())
    ours, theirs = geir.run(g, feeds), geir.run(g, feeds, runtime="onnxruntime")
    for name in ours:
        assert theirs[name].dtype == ours[name].dtype
        assert_within_ulps_of_scale(theirs[name], ours[name].astype(np.float64), ours[name].dtype, ulps=2, what=name)


def test_graph_inputs_are_validated_before_the_run():
    g = moe_graph(4, 2, 4, (2, 2))
    feeds = {"tokens": np.ones((4, 2), np.float32), "indices": np.array([0, 1, 1, 3], np.int32),
             "probs": np.ones((2, 2), np.float32)}
    with pytest.raises(ExecutionError, match=r"\[MU-D1\] MoeTokenUnpermute 'node': input 1 'sorted_indices' "
                                             r"positions 1 and 2: .*got 1 twice"):
        geir.run(g, feeds, runtime="onnxruntime")
    c = AttentionCase(mode=0, K=3)
    a = c.arrays()
    a["sparse_indices"][1, 2, 0] = [0, 9, -1]
    g, feeds = sfa_graph(a, SFA, **dict(c.forward_attrs(), sparse_mode=0))
    with pytest.raises(ExecutionError, match=r"\[SA-D3\] SparseFlashAttention 'node': input 3 'sparse_indices' row "
                                             r"\(b=1, s1=2, n2=0\) entry 1"):
        geir.run(g, feeds, runtime="onnxruntime")


def test_feed_errors_and_sessions_are_cached():
    g = rotary_graph(ROPE_GRAD, (1, 2, 1, 8), (1, 2, 1, 8), rotary_mode=1, partial_slice=[0, 8])
    runtime = get_runtime("onnxruntime")
    assert runtime.compile(g) is runtime.compile(g)
    with pytest.raises(ExecutionError, match="input 'x': expected dtype float32, got float64"):
        geir.run(g, {"x": np.zeros((1, 2, 1, 8)), "cos": np.zeros((1, 2, 1, 8), np.float32),
                     "sin": np.zeros((1, 2, 1, 8), np.float32)}, runtime="onnxruntime")


def test_symbolic_and_data_dependent_output_shapes():
    b = geir.GraphBuilder("shapes")
    x = b.input("x", "float32", ("N", 4))
    b.output(b.op("Relu", x), "relu")
    b.output(b.op("NonZero", x), "nz")
    g = b.build()
    x_val = np.array([[1, -1, 0, 2], [0, 0, 3, -4], [5, 0, 0, 0]], np.float32)
    ours, theirs = geir.run(g, {"x": x_val}), geir.run(g, {"x": x_val}, runtime="onnxruntime")
    assert np.array_equal(theirs["relu"], ours["relu"]) and np.array_equal(theirs["nz"], ours["nz"])
    assert theirs["nz"].shape == (2, 6)  # six non-zero elements: a size no declared dim gives


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_outputs_it_allocates_are_independent_writable_arrays(dtype):
    """Outputs ONNX Runtime allocates (from its arena, bfloat16 included): the dtype and shape declared, writable,
    and a result stays as it was while later runs of the same executable reuse the arena."""
    g = rotary_graph(ROPE, (2, 3, 4, 24), (1, 3, 1, 24), dtype, rotary_mode=1)
    executable = get_runtime("onnxruntime").compile(g)
    first_feeds, second_feeds = random_feeds(g, seed=1), random_feeds(g, seed=2)
    first = executable.run(first_feeds)["y"]
    kept = first.copy()
    for _ in range(3):
        second = executable.run(second_feeds)["y"]
    assert first.dtype == DTYPES[dtype] and first.shape == (2, 3, 4, 24) and first.flags.writeable
    assert bits_equal(first, kept) and bits_equal(second, geir.run(g, second_feeds)["y"])
    first[...] = 0                               # the caller's to write: no other result changes
    assert bits_equal(second, geir.run(g, second_feeds)["y"])
    assert bits_equal(executable.run(first_feeds)["y"], kept)
    empty = rotary_graph(ROPE, (0, 3, 4, 24), (1, 3, 1, 24), dtype, rotary_mode=1)
    result = geir.run(empty, random_feeds(empty), runtime="onnxruntime")["y"]
    assert result.dtype == DTYPES[dtype] and result.shape == (0, 3, 4, 24)


def test_data_dependent_bfloat16_output():
    """A bfloat16 output whose size only the data gives (OrtValue.numpy() has no bfloat16: this was a RuntimeError)."""
    b = geir.GraphBuilder("data_dependent")
    x = b.input("x", "bfloat16", (6,))
    mask = b.input("mask", "float32", (6,))
    rows = b.op("Squeeze", b.op("NonZero", mask), b.constant("axes", np.array([0], np.int64)))
    b.output(b.op("Gather", x, rows), "y")
    g = b.build()
    feeds = {"x": np.arange(6).astype(ml_dtypes.bfloat16), "mask": np.array([0, 1, 0, 2, 3, 0], np.float32)}
    theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert bits_equal(theirs, geir.run(g, feeds)["y"]) and theirs.tolist() == [1, 3, 4]
