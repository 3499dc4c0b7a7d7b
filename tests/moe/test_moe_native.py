"""The MoE unpermute ops' native kernels (moe.c): they run instead of the function bodies and give the NumPy
kernel's bits (probs_grad within float32 rounding) for every dtype pair, vector rows and tails, awkward values, with
or without probs, wherever the outputs lie."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import geir
from helpers import awkward_values
from moe.helpers import bf16_tokens_f32_probs_expected, moe_grad_graph, moe_graph
from native_helpers import native_calls, requires_compiler
from oracles.moe import unpermute_grad_reference
from oracles.numerics import assert_matches_reference, assert_within_ulps_of_scale, bits_equal

pytestmark = [requires_compiler, bf16_tokens_f32_probs_expected]

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("tt, tp", [(t, p) for t in DTYPES for p in DTYPES])
def test_moe_native_parity(tt, tp):
    rng = np.random.default_rng(0)
    s = rng.permutation(12).astype(np.int32)
    probs = rng.uniform(-1, 1, (4, 3)).astype(DTYPES[tp])
    probs[1, 2] = 0
    feeds = {"tokens": rng.standard_normal((10, 5)).astype(DTYPES[tt]), "indices": s, "probs": probs}
    g = moe_graph(10, 5, 12, (4, 3), tt, tp)          # two dropped slots (rows 10, 11)
    before = native_calls()
    ours, theirs = geir.run(g, feeds)["y"], geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert native_calls() > before and bits_equal(theirs, ours)
    g = moe_grad_graph((12, 5), (4, 5), 12, (4, 3), tt, tp)
    feeds = {"tokens": rng.standard_normal((12, 5)).astype(DTYPES[tt]), "dy": rng.standard_normal((4, 5)).astype(DTYPES[tt]),
             "indices": s, "probs": probs}
    ours, theirs = geir.run(g, feeds), geir.run(g, feeds, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"])
    assert_within_ulps_of_scale(theirs["pg"], ours["pg"].astype(np.float64), DTYPES[tp], ulps=2)


@pytest.mark.parametrize("hidden", [16, 32, 48, 61, 1000])
@pytest.mark.parametrize("tt, tp", [("float32", "float32"), ("float16", "float32"), ("bfloat16", "bfloat16"),
                                    ("bfloat16", "float32"), ("float16", "float16")])
def test_moe_native_vector_rows_match_the_numpy_kernel(tt, tp, hidden):
    """Rows of whole vectors, and tails, through the vector paths: the forward and permuted_tokens_grad are
    bit-identical to the NumPy kernel with awkward values (NaN payloads, infinities, overflowing products, signed
    zeros, subnormals); probs_grad agrees within float32 rounding where both are finite."""
    rng = np.random.default_rng(hidden)
    tokens_n, topk, rows = 6, 3, 20            # slots 18 and 19 unused by the forward: dropped rows 18, 19
    s = rng.permutation(tokens_n * topk).astype(np.int32)
    probs = rng.uniform(-2, 2, (tokens_n, topk)).astype(DTYPES[tp])
    probs[1, 2] = 0
    feeds = {"tokens": awkward_values(rng, (rows, hidden), DTYPES[tt]), "indices": s, "probs": probs}
    g = moe_graph(rows, hidden, tokens_n * topk, (tokens_n, topk), tt, tp)
    before = native_calls()
    theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert native_calls() > before and bits_equal(theirs, geir.run(g, feeds)["y"])
    g = moe_grad_graph((tokens_n * topk, hidden), (tokens_n, hidden), tokens_n * topk, (tokens_n, topk), tt, tp)
    grad_feeds = {"tokens": feeds["tokens"][:tokens_n * topk], "dy": awkward_values(rng, (tokens_n, hidden), DTYPES[tt]),
                  "indices": s, "probs": probs}
    ours, theirs = geir.run(g, grad_feeds), geir.run(g, grad_feeds, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"])
    finite = {**grad_feeds, "tokens": rng.standard_normal((tokens_n * topk, hidden)).astype(DTYPES[tt]),
              "dy": rng.standard_normal((tokens_n, hidden)).astype(DTYPES[tt])}
    ours, theirs = geir.run(g, finite), geir.run(g, finite, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"])
    *_, pg64, magnitude = unpermute_grad_reference(finite["tokens"], finite["dy"], s, probs)
    bound = (hidden / 32 + 7) * 2.0 ** -24     # float32 sums of hidden / 32 terms per lane, then a tree of 5 levels
    for got in (ours["pg"], theirs["pg"]):
        assert_matches_reference(got, pg64, magnitude, "probs_grad", compute_rel=bound, f32_rel=bound)


@pytest.mark.parametrize("tt", list(DTYPES))
def test_moe_native_grad_does_not_depend_on_where_the_outputs_lie(tt):
    """Caller buffers at every offset (streamed stores need 16-byte alignment, so some rows are streamed and some
    not): the same bits as runtime-allocated outputs, probs_grad included."""
    rng = np.random.default_rng(7)
    tokens_n, topk, hidden = 5, 2, 72
    g = moe_grad_graph((tokens_n * topk, hidden), (tokens_n, hidden), tokens_n * topk, (tokens_n, topk), tt)
    feeds = {"tokens": rng.standard_normal((tokens_n * topk, hidden)).astype(DTYPES[tt]),
             "dy": rng.standard_normal((tokens_n, hidden)).astype(DTYPES[tt]),
             "indices": rng.permutation(tokens_n * topk).astype(np.int32),
             "probs": rng.uniform(-1, 1, (tokens_n, topk)).astype(DTYPES[tt])}
    executable = geir.runtimes.get_runtime("onnxruntime").compile(g)
    want = executable.run(feeds)
    size = np.dtype(DTYPES[tt]).itemsize
    for offset in range(0, 32, size):
        raw = np.empty(tokens_n * topk * hidden * size + 64, np.uint8)
        start = -raw.ctypes.data % 32 + offset
        ptg = raw[start:start + tokens_n * topk * hidden * size].view(DTYPES[tt]).reshape(tokens_n * topk, hidden)
        got = executable.run(feeds, outputs={"ptg": ptg, "pg": np.empty((tokens_n, topk), DTYPES[tt])})
        assert bits_equal(got["ptg"], want["ptg"]) and bits_equal(got["pg"], want["pg"]), offset


@pytest.mark.parametrize("tt", list(DTYPES))
def test_moe_native_without_probs(tt):
    rng = np.random.default_rng(1)
    s = rng.permutation(6).astype(np.int32)
    feeds = {"tokens": rng.standard_normal((6, 4)).astype(DTYPES[tt]), "indices": s}
    g = moe_graph(6, 4, 6, None, tt)
    assert bits_equal(geir.run(g, feeds, runtime="onnxruntime")["y"], geir.run(g, feeds)["y"])
    g = moe_grad_graph(None, (6, 4), 6, None, tt)
    feeds = {"dy": feeds["tokens"], "indices": s}
    ours, theirs = geir.run(g, feeds), geir.run(g, feeds, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"]) and bits_equal(theirs["pg"], ours["pg"])
