"""Run-time data rules (MP-D1 expert ids CANN sorts; MPG-D1 sorted_indices a permutation) on both runtimes, and the
ONNX export: checker-clean, imported back to the same graph, and run by a stock ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import geir
from geir import ExecutionError
from moe_permute.helpers import permute_grad_graph, permute_graph
from oracles.moe_permute import permute_reference
from oracles.onnx_runners import run_onnxruntime

RUNTIMES = ("numpy", "onnxruntime")


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("bad, where", [(-1, "position (1, 0)"), (16777215, "position (1, 0)"), (-5, "position (1, 0)")])
def test_ids_outside_what_cann_sorts_are_refused(runtime, index_dtype, bad, where):
    """aclnnMoeTokenPermute.md: ids in [0, 16777215) (an older revision: int32/int64 min and max as single points)."""
    ids = np.array([[0, 1], [bad, 2], [3, 3]], index_dtype)
    with pytest.raises(ExecutionError, match=rf"\[MP-D1\] MoeTokenPermute 'node': input 1 'indices' {re_escape(where)}.*"
                                             rf"got {bad}"):
        geir.run(permute_graph((3, 4), (3, 2), index_dtype=index_dtype),
                 {"tokens": np.zeros((3, 4), np.float32), "indices": ids}, runtime=runtime)


def re_escape(text: str) -> str:
    import re
    return re.escape(text)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_the_extremes_of_the_index_dtype_are_accepted(runtime, index_dtype):
    info = np.iinfo(index_dtype)
    ids = np.array([[info.max, 1], [info.min, 16777214]], index_dtype)
    got = geir.run(permute_graph((2, 4), (2, 2), index_dtype=index_dtype),
                   {"tokens": np.eye(2, 4, dtype=np.float32), "indices": ids}, runtime=runtime)
    assert list(got["sorted"]) == list(permute_reference(np.eye(2, 4), ids)[1]) == [3, 1, 0, 2]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("indices, fact", [([0, 1, 2, 4], "position 3: expected a value in [0, 4)"),
                                           ([0, 1, 1, 2], "positions 1 and 2: expected distinct values"),
                                           ([0, -1, 1, 2], "position 1")])
def test_grad_sorted_indices_must_be_a_permutation(runtime, indices, fact):
    with pytest.raises(ExecutionError, match=r"\[MPG-D1\] MoeTokenPermuteGrad 'node'.*" + re_escape(fact)):
        geir.run(permute_grad_graph(4, 3, 4, num_topk=2),
                 {"grad": np.zeros((4, 3), np.float32), "sorted": np.array(indices, np.int32)}, runtime=runtime)


def _pair(dtype: str) -> geir.Graph:
    b = geir.GraphBuilder("permute_pair")
    tokens, ids = b.input("tokens", dtype, (5, 6)), b.input("ids", "int64", (5, 2))
    rows, s = b.MoeTokenPermute(tokens, ids, num_out_tokens=-2, name="permute")
    b.output(rows, "rows")
    b.output(b.MoeTokenPermuteGrad(rows, s, num_topk=2, name="grad") if dtype != "int8" else s, "back")
    return b.build()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_export_round_trip_and_stock_onnxruntime(dtype, tmp_path):
    graph = _pair(dtype)
    path = tmp_path / "permute.onnx"
    geir.save_onnx(graph, str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert {f.name for f in model.functions} >= {"MoeTokenPermute"}
    loaded = geir.load_onnx(str(path))
    assert [n.op_type for n in loaded.nodes] == [n.op_type for n in graph.nodes]
    assert loaded.nodes[0].attributes["num_out_tokens"] == -2
    rng = np.random.default_rng(4)
    tokens = rng.integers(-9, 9, (5, 6)).astype(geir.as_dtype(dtype).numpy)
    feeds = {"tokens": tokens, "ids": rng.integers(0, 4, (5, 2)).astype(np.int64)}
    want = geir.run(graph, feeds)
    stock = run_onnxruntime(model, feeds)                  # no geir library: the function bodies run
    for name in ("rows", "back"):
        for got in (stock[name], geir.run(loaded, feeds, runtime="onnxruntime")[name]):
            assert np.array_equal(np.asarray(got).astype(np.float64), want[name].astype(np.float64)), name


@pytest.mark.parametrize("graph, feeds", [
    (lambda: permute_graph((3, 4), (3, 0)), {"tokens": np.ones((3, 4), np.float32),
                                             "indices": np.zeros((3, 0), np.int32)}),     # topK 0: no slots
    (lambda: permute_grad_graph(6, 0, 6, num_topk=2), {"grad": np.zeros((6, 0), np.float32),
                                                       "sorted": np.arange(6, dtype=np.int32)}),   # hidden 0
])
def test_empty_extents_run_on_stock_onnxruntime_as_on_geir(graph, feeds):
    """Review of issue 27: the bodies once divided by K = 0 (ORT refused to load the model) and reshaped with -1
    beside a 0 (Reshape refused); every runtime now gives the same empty results."""
    built = graph()
    model = geir.to_onnx(built)
    stock = run_onnxruntime(model, feeds)
    for runtime in RUNTIMES:
        ran = geir.run(built, feeds, runtime=runtime)
        for name, want in ran.items():
            assert np.asarray(stock[name]).shape == want.shape and np.array_equal(stock[name], want), name
