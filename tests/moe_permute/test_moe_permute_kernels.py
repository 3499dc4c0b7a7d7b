"""MoeTokenPermute(Grad) on both runtimes: the worked examples in every dtype, the float64 oracle, bit parity of the
NumPy kernel, the native kernel and the ONNX function body (stock ONNX Runtime on the exported model) for every
token dtype and int32/int64 ids, and the identities that tie the pair to MoeTokenUnpermute."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.runtimes.onnxruntime import native_library
from geir.ir._dtypes import as_dtype
from geir.schemas import all_examples, get_schema
from moe_permute.helpers import (FLOATS, PERMUTE, PERMUTE_GRAD, TOKEN_DTYPES, permute_grad_graph, permute_graph,
                                 random_tokens, routing)
from native_helpers import native_calls
from oracles.moe_permute import permute_grad_reference, permute_reference
from oracles.onnx_runners import run_onnxruntime

RUNTIMES = ("numpy", "onnxruntime")


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes (int8 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def _stock(graph: geir.Graph, feeds: dict) -> dict:
    """The exported model on a stock ONNX Runtime session (no geir library: the function bodies run)."""
    return run_onnxruntime(geir.to_onnx(graph), feeds)


@pytest.mark.parametrize("op", [PERMUTE, PERMUTE_GRAD])
def test_worked_examples_on_every_runtime(op):
    schema = get_schema(op)
    for example in all_examples(schema):
        for dtype in example.dtypes:
            feeds = {k: np.asarray(v).astype(as_dtype(example.input_dtype(k, dtype)).numpy)
                     for k, v in example.inputs.items()}
            b = geir.GraphBuilder("example")
            outs = b.add_node(schema, [b.input(k, a.dtype, a.shape) for k, a in feeds.items()],
                              dict(example.attributes), name="node")
            for spec, value in zip(schema.outputs, outs if isinstance(outs, tuple) else (outs,)):
                b.output(value, f"{spec.name}_out")
            graph = b.build()
            for runtime in RUNTIMES:
                got = geir.run(graph, feeds, runtime=runtime)
                for name, want in example.expected.items():
                    have = got[f"{name}_out"]
                    assert np.array_equal(have.astype(np.float64), np.asarray(want).astype(have.dtype).astype(
                        np.float64)), (example.name, dtype, runtime, name)


@pytest.mark.parametrize("dtype", list(TOKEN_DTYPES))
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("distinct", [True, False])
def test_permute_matches_the_oracle_bit_for_bit_everywhere(dtype, index_dtype, distinct):
    """Ties (repeated ids within a token) included: the stable order by slot decides them on every runtime."""
    rng = np.random.default_rng(len(dtype) + distinct)
    for tokens, topk, hidden, n in ((13, 3, 37, 0), (9, 4, 16, 20), (9, 4, 16, -7), (7, 1, 5, 0)):
        ids = routing(rng, tokens, topk, 6, index_dtype, distinct)
        feeds = {"tokens": random_tokens(rng, (tokens, hidden), dtype), "indices": ids}
        graph = permute_graph((tokens, hidden), ids.shape, dtype, index_dtype, num_out_tokens=n)
        want_rows, want_sorted = permute_reference(feeds["tokens"], ids, n)
        counted = native_library() is not None      # without the library (no C compiler) the bodies run
        before = native_calls() if counted else 0
        results = [geir.run(graph, feeds, runtime=r) for r in RUNTIMES] + [_stock(graph, feeds)]
        assert not counted or native_calls() > before
        for got in results:
            assert bits_equal(got["rows"], want_rows) and np.array_equal(got["sorted"], want_sorted)


def test_permute_extreme_ids_and_rank_three_tokens():
    """The index dtype's minimum and maximum (CANN's single points) sort first and last; trailing dims are the
    hidden size."""
    ids = np.array([[2, np.iinfo(np.int64).max], [np.iinfo(np.int64).min, 0], [16777214, 2]], np.int64)
    tokens = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    graph = permute_graph(tokens.shape, ids.shape, index_dtype="int64")
    want_rows, want_sorted = permute_reference(tokens, ids)
    for got in [geir.run(graph, {"tokens": tokens, "indices": ids}, runtime=r) for r in RUNTIMES] + \
            [_stock(graph, {"tokens": tokens, "indices": ids})]:
        assert np.array_equal(got["rows"], want_rows) and np.array_equal(got["sorted"], want_sorted)
    assert list(want_sorted) == [2, 5, 0, 1, 4, 3]


@pytest.mark.parametrize("dtype", list(FLOATS))
def test_permute_grad_matches_the_oracle_and_is_the_same_bits_everywhere(dtype):
    rng = np.random.default_rng(5)
    for tokens, topk, hidden, rows in ((11, 3, 37, 33), (8, 4, 16, 20), (6, 1, 70, 6), (4, 2, 3, 0)):
        s = rng.permutation(tokens * topk).astype(np.int32)
        feeds = {"grad": rng.standard_normal((rows, hidden)).astype(FLOATS[dtype]), "sorted": s}
        graph = permute_grad_graph(rows, hidden, tokens * topk, dtype, num_topk=topk)
        want = permute_grad_reference(feeds["grad"], s, topk)
        ours = geir.run(graph, feeds)["dx"]
        magnitude = permute_grad_reference(np.abs(feeds["grad"].astype(np.float64)), s, topk)
        bound = (topk * 2.0 ** -24 + {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dtype]) * magnitude
        assert np.all(np.abs(ours.astype(np.float64) - want) <= bound)       # K float32 adds, one rounding
        assert bits_equal(geir.run(graph, feeds, runtime="onnxruntime")["dx"], ours)
        stock = _stock(graph, feeds)["dx"]                # ReduceSum over K: its order is ONNX Runtime's to choose
        np.testing.assert_allclose(stock.astype(np.float64), ours.astype(np.float64), rtol=1e-2, atol=1e-2)


def test_permute_grad_is_the_unweighted_unpermute_bit_for_bit():
    """input_grad(g, s, K) == MoeTokenUnpermute(g, s, probs of ones (T, K)) in every dtype: one definition."""
    rng = np.random.default_rng(9)
    for dtype, np_dtype in FLOATS.items():
        g, s = rng.standard_normal((12, 33)).astype(np_dtype), rng.permutation(15).astype(np.int32)   # 3 rows dropped
        b = geir.GraphBuilder("both")
        grad, idx = b.input("grad", dtype, (12, 33)), b.input("sorted", "int32", (15,))
        b.output(b.MoeTokenPermuteGrad(grad, idx, num_topk=3), "dx")
        b.output(b.MoeTokenUnpermute(grad, idx, b.constant("ones", np.ones((5, 3), np_dtype))), "y")
        graph = b.build()
        for runtime in RUNTIMES:
            got = geir.run(graph, {"grad": g, "sorted": s}, runtime=runtime)
            assert bits_equal(got["dx"], got["y"]), (dtype, runtime)


def test_permute_then_unpermute_round_trips_and_the_pair_is_adjoint():
    """unpermute(permute(x).rows, sorted) == K * x (every slot kept); <permute(x), g> == <x, permute_grad(g)>."""
    rng = np.random.default_rng(2)
    x, ids = rng.standard_normal((10, 8)), routing(rng, 10, 3, 5)
    rows, s = permute_reference(x, ids)
    b = geir.GraphBuilder("round_trip")
    tokens, indices = b.input("x", "float32", (10, 8)), b.input("e", "int32", (10, 3))
    permuted, sorted_indices = b.MoeTokenPermute(tokens, indices)
    b.output(b.MoeTokenUnpermute(permuted, sorted_indices, b.constant("w", np.ones((10, 3), np.float32))), "y")
    graph = b.build()
    for runtime in RUNTIMES:
        y = geir.run(graph, {"x": x.astype(np.float32), "e": ids}, runtime=runtime)["y"]
        np.testing.assert_allclose(y, 3 * x.astype(np.float32), rtol=1e-6)
    g = rng.standard_normal(rows.shape)
    assert np.isclose(np.sum(rows * g), np.sum(x * permute_grad_reference(g, s, 3)), rtol=1e-12)
