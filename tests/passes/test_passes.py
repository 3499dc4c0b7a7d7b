from __future__ import annotations

import pytest

import geir
from geir import Graph, GraphError, Node, TensorType, Value
from geir.passes import (EliminateDeadCode, InferShapes, Pass, PassManager, PassResult, VerifyGraph,
                         build_pipeline, live_nodes)
from rotary.helpers import ROPE_GRAD

T = TensorType("float32", (1, 2, 1, 8))


def _manual_graph():
    g = Graph("manual")
    x, c = Value("x", T), Value("c", T)
    g.inputs += [x, c]
    return g, x, c


def test_pipeline_on_a_hand_made_graph_fills_defaults_and_types():
    g, x, c = _manual_graph()
    node = Node(ROPE_GRAD, [x, c, c], {"partial_slice": [0, 8]}, [("y", TensorType("float16", (9,)))], name="n")
    g.nodes.append(node)
    g.outputs.append(node.outputs[0])
    graph, modified = build_pipeline()(g)
    assert modified and graph.properties >= {"verified", "typed"}
    assert node.attributes == {"rotary_mode": 0, "partial_slice": (0, 8)}
    assert node.outputs[0].type == T  # inference replaced the wrong stored type


def test_verify_rejects_structural_errors():
    g, x, c = _manual_graph()
    a = Node(ROPE_GRAD, [None, c, c], {}, [("a", T)], name="a")
    b = Node(ROPE_GRAD, [a.outputs[0], c, c], {}, [("b", T)], name="b")
    a.set_input(0, b.outputs[0])
    g.nodes += [a, b]
    g.outputs.append(b.outputs[0])
    with pytest.raises(GraphError, match="graph 'manual' has a cycle: 'a' -> 'b' -> 'a'|has a cycle: 'b' -> 'a' -> 'b'"):
        VerifyGraph()(g)

    g, x, c = _manual_graph()
    stranger = Value("stranger", T)
    g.nodes.append(Node(ROPE_GRAD, [stranger, c, c], {}, [("y", T)], name="n"))
    g.outputs.append(g.nodes[0].outputs[0])
    with pytest.raises(GraphError, match="input 0 'stranger' is not a value of graph 'manual'"):
        VerifyGraph()(g)

    g, x, c = _manual_graph()
    g.nodes.append(Node(ROPE_GRAD, [x, c, c], {}, [("x", T)], name="n"))
    g.outputs.append(g.nodes[0].outputs[0])
    with pytest.raises(GraphError, match="value name 'x' is defined twice"):
        VerifyGraph()(g)

    g, x, c = _manual_graph()
    g.outputs.append(Value("ghost", T))
    with pytest.raises(GraphError, match="output 'ghost' is not produced in the graph"):
        VerifyGraph()(g)

    g, x, c = _manual_graph()
    g.nodes.append(Node("Mystery", [x], {}, [("y", T)], name="m"))
    g.outputs.append(g.nodes[0].outputs[0])
    with pytest.raises(GraphError, match=r"\[SCH-1\] Mystery 'm'"):
        VerifyGraph()(g)

    g, x, c = _manual_graph()
    g.nodes.append(Node(ROPE_GRAD, [x, c, c], {"rotary_mode": "1"}, [("y", T)], name="n"))
    g.outputs.append(g.nodes[0].outputs[0])
    with pytest.raises(GraphError, match=r"\[SCH-3\] .*'n': attribute 'rotary_mode': expected kind Int, got '1'"):
        VerifyGraph()(g)

    g, x, c = _manual_graph()
    g.nodes.append(Node(ROPE_GRAD, [x, c, c], {}, [("y", T), ("z", T)], name="n"))
    g.outputs.append(g.nodes[0].outputs[0])
    with pytest.raises(GraphError, match=r"\[SCH-2\] .*outputs: expected 1 output slots, got 2"):
        VerifyGraph()(g)


def test_infer_shapes_rejects_semantic_errors_of_hand_made_nodes():
    g, x, c = _manual_graph()
    g.nodes.append(Node(ROPE_GRAD, [x, c, c], {"partial_slice": [0, 6]}, [("y", T)], name="n"))
    g.outputs.append(g.nodes[0].outputs[0])
    with pytest.raises(GraphError, match=r"\[RP-S7\] InplacePartialRotaryMulGrad 'n': input 1 'cos' dim 3"):
        build_pipeline()(g)


def test_pass_requirements_are_enforced():
    g, x, c = _manual_graph()
    with pytest.raises(GraphError, match=r"pass InferShapes requires \['verified'\]"):
        InferShapes()(g)

    class Counting(Pass):
        ensures = frozenset({"counted"})

        def call(self, graph):
            return PassResult(graph, False)

    graph, modified = PassManager([Counting()])(g)
    assert not modified and "counted" in graph.properties


def test_dead_code_elimination_keeps_what_outputs_need():
    b = geir.GraphBuilder("dce")
    x = b.input("x", "float32", (1, 2, 1, 8))
    c = b.input("c", "float32", (1, 2, 1, 8))
    live = b.InplacePartialRotaryMulGrad(x, c, c, partial_slice=[0, 8], name="live")
    dead = b.InplacePartialRotaryMulGrad(x, c, c, partial_slice=[0, 8], name="dead")
    b.InplacePartialRotaryMulGrad(dead, c, c, partial_slice=[0, 8], name="dead_too")
    b.output(live, "y")
    g = b.build()
    assert {n.name for n in live_nodes(g)} == {"live"}
    _, modified = EliminateDeadCode()(g)
    assert modified and [n.name for n in g.nodes] == ["live"]
    assert x.uses == ((g.nodes[0], 0),)  # the dead nodes no longer count as uses
    assert not EliminateDeadCode()(g).modified


# -- the graph-editing API and honest pass contracts ------------------------------------------------

def _chain():
    """x -> rotary grad 'first' -> rotary grad 'second' -> output."""
    import geir

    b = geir.GraphBuilder("chain")
    x = b.input("x", "float32", (1, 1, 1, 4))
    c = b.input("c", "float32", (1, 1, 1, 4))
    first = b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 4], name="first")
    second = b.InplacePartialRotaryMulGrad(first, c, c, rotary_mode=1, partial_slice=[0, 4], name="second")
    b.output(second, "y")
    return b.build(), x, c


def test_replace_all_uses_remove_and_insert_edit_a_built_graph():
    import numpy as np

    import geir

    g, x, c = _chain()
    first, second = g.node("first"), g.node("second")
    assert {"verified", "typed"} <= g.properties
    first.outputs[0].replace_all_uses_with(x, g)       # bypass 'first'
    assert second.inputs[0] is x and not first.outputs[0].uses
    assert g.properties == set()                      # the editing call cleared the guarantees
    g.remove(first)
    assert [n.name for n in g.nodes] == ["second"]
    with pytest.raises(GraphError, match=r"cannot remove InplacePartialRotaryMulGrad 'second': its output 'y' is "
                                         r"used by the graph outputs"):
        g.remove(second)
    again = Node(ROPE_GRAD, [x, c, c], {"rotary_mode": 1, "partial_slice": (0, 4)}, [("z", x.type)], name="again")
    g.insert_before(second, again)
    second.set_input(0, again.outputs[0])
    assert [n.name for n in g.nodes] == ["again", "second"]
    with pytest.raises(GraphError, match="is already in this graph"):
        g.append(again)
    built, _ = geir.passes.build_pipeline()(g)
    assert {"verified", "typed"} <= built.properties
    feeds = {"x": np.array([[[[1, 2, 3, 4]]]], np.float32), "c": np.ones((1, 1, 1, 4), np.float32)}
    np.testing.assert_array_equal(geir.run(built, feeds)["y"].reshape(-1), [4, -2, 8, -6])


def test_set_input_on_a_built_graph_clears_its_guarantees_and_a_node_has_one_graph():
    """An edit through the node itself must not leave a graph that runs as if still verified."""
    g, x, _ = _chain()
    first, second = g.node("first"), g.node("second")
    assert first.graph is g and second.graph is g
    second.set_input(0, x)
    assert g.properties == set()
    with pytest.raises(GraphError, match="is not built"):
        geir.run(g, {})
    other = Graph("other")
    with pytest.raises(GraphError, match="node 'first' belongs to graph 'chain'; remove it there first"):
        other.append(first)
    g.remove(first)
    assert first.graph is None
    other.append(first)
    assert first.graph is other


def test_a_modifying_pass_keeps_only_what_it_preserves():
    from geir.passes import EliminateDeadCode, FillDefaults, InferShapes, Pass, PassResult

    class Scramble(Pass):
        """Pretends to change the graph and preserve nothing."""

        def call(self, graph):
            return PassResult(graph, True)

    g, _, _ = _chain()
    Scramble()(g)
    assert g.properties == set()
    g, _, _ = _chain()
    EliminateDeadCode()(g)            # nothing dead: not modified, properties stay
    assert {"verified", "typed"} <= g.properties
    g.invalidate()
    with pytest.raises(GraphError, match=r"pass InferShapes requires \['verified'\]"):
        InferShapes()(g)
    assert FillDefaults.preserves == {"verified", "typed"} and InferShapes.preserves == {"verified"}


def test_each_rule_runs_once_per_build(monkeypatch):
    import geir
    from geir.ir._schema import OpSchema

    calls = []
    original = OpSchema.infer_types
    monkeypatch.setattr(OpSchema, "infer_types", lambda self, ctx: calls.append(ctx.node) or original(self, ctx))
    _chain()
    assert calls == ["first", "second"]
    g, _, _ = _chain()
    calls.clear()
    geir.from_onnx(geir.to_onnx(g))
    assert len(calls) == 4                                   # export's full_check once per node, import's build
    assert calls[2:] == ["first", "second"]


def test_a_builder_extends_a_built_graph():
    import numpy as np

    import geir

    g, x, c = _chain()
    b = geir.GraphBuilder.extend(g)
    with pytest.raises(GraphError, match="name 'first' is already used"):
        b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 4], name="first")
    third = b.InplacePartialRotaryMulGrad(g.outputs[0], c, c, rotary_mode=1, partial_slice=[0, 4])
    b.output(third, "z")
    built = b.build()
    assert built is g and [v.name for v in built.outputs] == ["y", "z"] and {"verified", "typed"} <= g.properties
    feeds = {"x": np.array([[[[1, 2, 3, 4]]]], np.float32), "c": np.ones((1, 1, 1, 4), np.float32)}
    out = geir.run(built, feeds)
    np.testing.assert_array_equal(out["z"].reshape(-1), [2, -6, 2, -14])   # [4,-2,8,-6] rotated again
