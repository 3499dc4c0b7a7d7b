"""Fed-shape checks cost a lookup on shapes seen before: ONNX's shape inference runs once per node and shapes,
a failure raises on every run, and an edit forgets what was remembered."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.runtimes import _checks


def _graph() -> geir.Graph:
    b = geir.GraphBuilder("dyn")
    x = b.input("x", "float32", ("B", "S", 4))
    y = b.input("y", "float32", ("B", 1, 4))
    b.output(b.op("Softmax", b.op("Add", x, y), axis=-1), "z")
    return b.build()


@pytest.fixture
def inferences(monkeypatch):
    calls: list[str] = []
    real = _checks.infer_node

    def counting(node, *args):
        calls.append(node.op_type)
        return real(node, *args)
    monkeypatch.setattr(_checks, "infer_node", counting)
    return calls


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_shapes_seen_before_are_not_inferred_again(runtime, inferences):
    graph = _graph()
    executable = geir.runtimes.get_runtime(runtime).compile(graph)
    rng = np.random.default_rng(0)
    small = {"x": rng.standard_normal((2, 3, 4), np.float32), "y": rng.standard_normal((2, 1, 4), np.float32)}
    large = {"x": rng.standard_normal((1, 5, 4), np.float32), "y": rng.standard_normal((1, 1, 4), np.float32)}
    inferences.clear()
    first = {name: executable.run(feeds)["z"] for name, feeds in (("small", small), ("large", large))}
    assert sorted(inferences) == ["Add", "Add", "Softmax", "Softmax"]      # once per node and fed shapes
    for name, feeds in (("small", small), ("large", large), ("small", small)):
        np.testing.assert_array_equal(executable.run(feeds)["z"], first[name])
    assert len(inferences) == 4                                              # and never again


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_a_shape_the_rules_refuse_is_refused_on_every_run(runtime):
    executable = geir.runtimes.get_runtime(runtime).compile(_graph())
    bad = {"x": np.ones((2, 3, 4), np.float32), "y": np.ones((3, 1, 4), np.float32)}   # B bound twice
    for _ in range(2):
        with pytest.raises(geir.ExecutionError):
            executable.run(bad)


def test_an_edit_forgets_the_remembered_shapes():
    graph = _graph()
    geir.run(graph, {"x": np.ones((2, 3, 4), np.float32), "y": np.ones((2, 1, 4), np.float32)}, runtime="onnxruntime")
    assert ("checks", "types on fed shapes") in graph.compiled or ("checks", "concrete types") in graph.compiled
    graph.invalidate()
    assert not any(key[0] == "checks" for key in graph.compiled if isinstance(key, tuple))
