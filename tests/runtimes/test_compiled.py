"""Executables per graph revision (runtimes/_compiled.py): compiled once, stale ones refused, freed with the graph."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import geir
from geir.ir._core import Graph
from geir.passes import Pass, PassResult
from geir.runtimes import get_runtime

RUNTIMES = ("numpy", "onnxruntime")
FEEDS = {"x": np.array([-1.0, 2.0, -3.0, 4.0], np.float32)}


def _relu_graph() -> Graph:
    b = geir.GraphBuilder("edited")
    x = b.input("x", "float32", (4,))
    b.output(b.op("Relu", x, name="relu"), "y")
    return b.build()


def _negate_before_relu(graph: Graph) -> Graph:
    """Edit ``graph`` in place (Relu(x) -> Relu(Neg(x))) and build it again: the same object, a new revision."""
    extension = geir.GraphBuilder.extend(graph)
    negated = extension.op("Neg", graph.inputs[0], name="neg")
    graph.node("relu").set_input(0, negated)
    rebuilt = extension.build()
    assert rebuilt is graph
    return rebuilt


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_compiling_an_unchanged_graph_again_returns_the_same_executable(runtime, monkeypatch):
    graph = _relu_graph()
    first = get_runtime(runtime).compile(graph)
    assert get_runtime(runtime).compile(graph) is first
    made = []
    monkeypatch.setattr(type(first), "__init__", lambda self, g: made.append(g))   # any new compile would show
    for _ in range(3):
        np.testing.assert_array_equal(geir.run(graph, FEEDS, runtime=runtime)["y"], [0, 2, 0, 4])
    assert made == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_graph_edited_and_built_again_runs_what_it_now_says(runtime):
    graph = _relu_graph()
    stale = get_runtime(runtime).compile(graph)
    np.testing.assert_array_equal(stale.run(FEEDS)["y"], [0, 2, 0, 4])
    _negate_before_relu(graph)
    np.testing.assert_array_equal(geir.run(graph, FEEDS, runtime=runtime)["y"], [1, 0, 3, 0])
    assert get_runtime(runtime).compile(graph) is not stale
    with pytest.raises(geir.ExecutionError, match=rf"graph 'edited' was edited after it was compiled for {runtime}"):
        stale.run(FEEDS)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_edited_graph_is_not_run_until_built_again(runtime):
    graph = _relu_graph()
    executable = get_runtime(runtime).compile(graph)
    geir.GraphBuilder.extend(graph).op("Neg", graph.inputs[0], name="neg")   # appending a node is an edit
    with pytest.raises(geir.GraphError, match="not built"):
        geir.run(graph, FEEDS, runtime=runtime)
    with pytest.raises(geir.ExecutionError, match="was edited after it was compiled"):
        executable.run(FEEDS)


class _RenameRelu(Pass):
    """A pass that modifies the graph while keeping its guarantees: still a new revision."""

    preserves = frozenset({"verified", "typed"})

    def call(self, graph: Graph) -> PassResult:
        graph.node("relu").name = "relu_renamed"
        return PassResult(graph, True)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_pass_that_modifies_the_graph_makes_a_new_revision(runtime):
    graph = _relu_graph()
    executable = get_runtime(runtime).compile(graph)
    before = graph.revision
    _RenameRelu()(graph)
    assert graph.revision > before and {"verified", "typed"} <= graph.properties
    with pytest.raises(geir.ExecutionError, match="was edited after it was compiled"):
        executable.run(FEEDS)
    np.testing.assert_array_equal(geir.run(graph, FEEDS, runtime=runtime)["y"], [0, 2, 0, 4])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_executable_is_freed_with_its_graph(runtime):
    graph = _relu_graph()
    geir.run(graph, FEEDS, runtime=runtime)
    alive = weakref.ref(graph), weakref.ref(get_runtime(runtime).compile(graph))
    del graph
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


def test_both_runtimes_run_the_attributes_they_were_compiled_with():
    """Editing an attribute in place needs ``invalidate()``; until the graph is built again neither runtime's
    executable picks the change up halfway (the exported model could not), so the two keep agreeing."""
    b = geir.GraphBuilder("rope")
    x = b.input("x", "float32", (1, 2, 1, 8))
    c = b.input("c", "float32", (1, 2, 1, 8))
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=0, partial_slice=[0, 8], name="rope"), "y")
    graph = b.build()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 2, 1, 8), np.float32), "c": rng.standard_normal((1, 2, 1, 8), np.float32)}
    executables = [get_runtime(r).compile(graph) for r in RUNTIMES]
    before = [e.run(feeds)["y"] for e in executables]
    np.testing.assert_array_equal(before[0], before[1])
    graph.node("rope").attributes["rotary_mode"] = 1     # an in-place attribute edit, not announced
    for executable, expected in zip(executables, before):
        np.testing.assert_array_equal(executable.run(feeds)["y"], expected)
    graph.invalidate()
    rebuilt = geir.GraphBuilder.extend(graph).build()
    after = [geir.run(rebuilt, feeds, runtime=r)["y"] for r in RUNTIMES]
    np.testing.assert_array_equal(after[0], after[1])
    assert not np.array_equal(after[0], before[0])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_feeds_are_checked_against_the_inputs_of_the_current_revision(runtime):
    graph = _relu_graph()
    geir.run(graph, FEEDS, runtime=runtime)
    extension = geir.GraphBuilder.extend(graph)
    wider = extension.input("wide", "float32", (5,))
    old = graph.inputs[0]
    graph.node("relu").set_input(0, wider)
    graph.inputs.remove(old)
    extension.build()
    with pytest.raises(geir.ExecutionError, match=r"unexpected feed\(s\) \['x'\]; inputs are \['wide'\]"):
        geir.run(graph, FEEDS, runtime=runtime)
    wide = np.array([-1, 1, -2, 2, -3], np.float32)
    np.testing.assert_array_equal(geir.run(graph, {"wide": wide}, runtime=runtime)["y"], [0, 1, 0, 2, 0])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_compiled_graph_can_still_be_copied_and_pickled(runtime):
    import copy
    import pickle

    graph = _relu_graph()
    geir.run(graph, FEEDS, runtime=runtime)
    for twin in (copy.deepcopy(graph), pickle.loads(pickle.dumps(graph))):
        assert twin.compiled == {} and graph.compiled
        np.testing.assert_array_equal(geir.run(twin, FEEDS, runtime=runtime)["y"], [0, 2, 0, 4])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_shallow_copy_is_independent_of_its_original(runtime):
    """Issue 23 item 10: copy.copy shared the node and output lists, so editing the copy edited the original
    behind its back (which then failed with a raw KeyError)."""
    import copy

    graph = _relu_graph()
    np.testing.assert_array_equal(geir.run(graph, FEEDS, runtime=runtime)["y"], [0, 2, 0, 4])
    twin = copy.copy(graph)
    assert twin.nodes is not graph.nodes and twin.outputs is not graph.outputs and twin.inputs is not graph.inputs
    assert not any(a is b for a, b in zip(twin.values(), graph.values()))
    revision = graph.revision
    _negate_before_relu(twin)
    np.testing.assert_array_equal(geir.run(twin, FEEDS, runtime=runtime)["y"], [1, 0, 3, 0])
    assert [n.name for n in graph.nodes] == ["relu"] and graph.revision == revision
    assert {"verified", "typed"} <= graph.properties
    np.testing.assert_array_equal(geir.run(graph, FEEDS, runtime=runtime)["y"], [0, 2, 0, 4])
    assert [n.op_type for n in twin.topological_order()] == ["Neg", "Relu"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_graph_whose_outputs_are_only_inputs_and_constants_runs(runtime):
    """Issue 23 item 15: ONNX Runtime refused the run ("At least one output should be requested")."""
    b = geir.GraphBuilder("pass_through")
    x = b.input("x", "float32", ("N",))
    b.output(x, "x")
    b.output(b.constant("w", np.array([1.5, -2.0], np.float32)), "w")
    graph = b.build()
    for n in (4, 2):
        feeds = {"x": np.arange(n, dtype=np.float32)}
        out = geir.run(graph, feeds, runtime=runtime)
        np.testing.assert_array_equal(out["x"], feeds["x"])
        np.testing.assert_array_equal(out["w"], [1.5, -2.0])
        assert not np.shares_memory(out["x"], feeds["x"]) and not np.shares_memory(out["w"], graph.constants["w"])
    buffers = {"x": np.empty(2, np.float32), "w": np.empty(2, np.float32)}
    out = geir.run(graph, {"x": np.array([7, 8], np.float32)}, runtime=runtime, outputs=buffers)
    assert out["x"] is buffers["x"] and out["w"] is buffers["w"]
    np.testing.assert_array_equal(buffers["x"], [7, 8])
    np.testing.assert_array_equal(buffers["w"], [1.5, -2.0])
