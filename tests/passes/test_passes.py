from __future__ import annotations

import pytest

import geir
from geir import Graph, GraphError, Node, TensorType, Value
from geir.passes import (EliminateDeadCode, InferShapes, Pass, PassManager, PassResult, VerifyGraph,
                         build_pipeline, live_nodes)
from helpers import ROPE_GRAD

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
