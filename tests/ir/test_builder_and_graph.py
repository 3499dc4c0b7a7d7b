from __future__ import annotations

import inspect

import numpy as np
import pytest

import geir
from geir import Graph, GraphError, Node, TensorType, Value
from rotary.helpers import ROPE, ROPE_GRAD


def _inputs(b, dtype="float16", x=(2, 4, 8, 64), c=(1, 4, 1, 32)):
    return b.input("dy", dtype, x), b.input("cos", dtype, c), b.input("sin", dtype, c)


def test_builder_api_of_the_design_document():
    b = geir.GraphBuilder("rope_grad")
    dy, cos, sin = _inputs(b)
    dx = b.InplacePartialRotaryMulGrad(dy, cos, sin, rotary_mode=1, partial_slice=[16, 48])
    assert isinstance(dx, Value) and dx.type == TensorType("float16", (2, 4, 8, 64))
    assert b.output(dx, "dx") is dx and dx.name == "dx"
    g = b.build()
    assert isinstance(g, Graph) and [v.name for v in g.outputs] == ["dx"]
    node = g.nodes[0]
    assert node.op_type == ROPE_GRAD and node.domain == "ai.cann"
    assert node.attributes == {"rotary_mode": 1, "partial_slice": (16, 48)}
    assert node.inputs == (dy, cos, sin) and dx.producer is node and dx.index == 0
    assert dy.uses == ((node, 0),) and cos.uses == ((node, 1),)
    assert node.location is not None and node.location.filename == __file__
    assert node.schema.outputs[0].alias == 0


def test_inputs_by_ge_ir_name_and_defaults_filled():
    b = geir.GraphBuilder("g")
    dy, cos, sin = _inputs(b, x=(2, 4, 8, 32))
    y = b.InplacePartialRotaryMulGrad(dy, sin=sin, cos=cos, partial_slice=[0, 32])
    node = y.producer
    assert node.inputs == (dy, cos, sin)
    assert node.attributes["rotary_mode"] == 0  # schema default
    b2 = geir.GraphBuilder("g2")
    x, c, s = _inputs(b2, x=(2, 4, 8, 32))
    assert b2.op(ROPE, x, c, s, rotary_mode=1).producer.attributes == {"rotary_mode": 1, "partial_slice": (0, 0)}


def test_generated_method_has_signature_and_doc():
    b = geir.GraphBuilder("g")
    sig = inspect.signature(b.InplacePartialRotaryMulGrad)
    assert list(sig.parameters) == ["dy", "cos", "sin", "rotary_mode", "partial_slice", "name"]
    assert sig.parameters["rotary_mode"].default == 0
    assert sig.parameters["rotary_mode"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "cos" in b.InplacePartialRotaryMul.__doc__ and "rotary_mode" in b.InplacePartialRotaryMul.__doc__
    assert ROPE in dir(b) and ROPE_GRAD in dir(b)


def test_unknown_op_and_unknown_keyword():
    b = geir.GraphBuilder("g")
    with pytest.raises(AttributeError, match="no attribute or registered op 'NoSuchOp'"):
        b.NoSuchOp
    with pytest.raises(GraphError, match=r"\[SCH-1\] NoSuchOp: op type: .*InplacePartialRotaryMul.*got unknown op"):
        b.op("NoSuchOp")
    dy, cos, sin = _inputs(b)
    with pytest.raises(GraphError, match=r"\[SCH-3\] .*keyword 'mode'.*an input \(dy, cos, sin\) or attribute"):
        b.InplacePartialRotaryMulGrad(dy, cos, sin, mode=1)


@pytest.mark.parametrize("attrs, pattern", [
    ({"rotary_mode": 1.0}, r"\[SCH-3\] InplacePartialRotaryMulGrad 'n': attribute 'rotary_mode': expected kind Int, got 1.0"),
    ({"rotary_mode": True}, r"attribute 'rotary_mode': expected kind Int, got True"),
    ({"partial_slice": [0, "8"]}, r"attribute 'partial_slice': expected kind ListInt"),
    ({"partial_slice": 8}, r"attribute 'partial_slice': expected kind ListInt, got 8"),
])
def test_attribute_kinds_are_enforced(attrs, pattern):
    b = geir.GraphBuilder("g")
    dy, cos, sin = _inputs(b)
    with pytest.raises(GraphError, match=pattern) as err:
        b.InplacePartialRotaryMulGrad(dy, cos, sin, name="n", **attrs)
    assert err.value.rule == "SCH-3" and err.value.node == "n"


def test_numpy_integers_are_accepted_as_int_attributes():
    b = geir.GraphBuilder("g")
    dy, cos, sin = _inputs(b)
    y = b.InplacePartialRotaryMulGrad(dy, cos, sin, rotary_mode=np.int64(1), partial_slice=np.array([16, 48]).tolist())
    assert y.producer.attributes == {"rotary_mode": 1, "partial_slice": (16, 48)}


def test_arity_and_dtype_rules():
    b = geir.GraphBuilder("g")
    dy, cos, sin = _inputs(b)
    with pytest.raises(GraphError, match=r"\[SCH-2\] .*'n': inputs: expected at most 3, got 4"):
        b.InplacePartialRotaryMulGrad(dy, cos, sin, dy, name="n")
    with pytest.raises(GraphError, match=r"\[SCH-2\] .*'n': input 2 'sin': expected a value \(required input\), got None"):
        b.InplacePartialRotaryMulGrad(dy, cos, name="n")
    idx = b.input("idx", "int32", (1, 4, 1, 32))
    with pytest.raises(GraphError, match=r"\[SCH-5\] .*input 1 'cos': expected dtype in \{float16, float32, bfloat16\}, got int32"):
        b.InplacePartialRotaryMulGrad(dy, idx, idx)
    c32 = b.input("c32", "float32", (1, 4, 1, 32))
    with pytest.raises(GraphError, match=r"\[SCH-6\] .*dtypes of \(dy, cos, sin\): expected one of .*got \(float16, float32, float16\)"):
        b.InplacePartialRotaryMulGrad(dy, c32, sin)
    x16 = b.input("x16", "float16", (2, 4, 8, 32))
    bf = b.input("cbf", "bfloat16", (1, 4, 1, 32))
    with pytest.raises(GraphError, match=r"\[SCH-6\] InplacePartialRotaryMul .*got \(float16, bfloat16, bfloat16\)"):
        b.InplacePartialRotaryMul(x16, bf, bf, partial_slice=[0, 32])
    with pytest.raises(GraphError, match="given both by position and by name"):
        b.InplacePartialRotaryMulGrad(dy, cos, sin, cos=cos)


@pytest.mark.parametrize("dy_dt, cos_dt", [(d, c) for d in ("float16", "float32", "bfloat16")
                                           for c in ("float16", "float32", "bfloat16")])
def test_grad_accepts_all_nine_dtype_pairs(dy_dt, cos_dt):
    b = geir.GraphBuilder("g")
    dy = b.input("dy", dy_dt, (1, 2, 1, 8))
    c = b.input("c", cos_dt, (1, 2, 1, 8))
    assert b.InplacePartialRotaryMulGrad(dy, c, c, partial_slice=[0, 8]).dtype.value == dy_dt


def test_required_attribute_rule_sch4():
    from geir.schemas import AttrKind, AttrSpec, OpSchema, OutputSpec
    schema = OpSchema("Probe", (), (OutputSpec("y"),), (AttrSpec("scale_value", AttrKind.FLOAT),), (),
                      infer=lambda ctx: None, check=lambda ctx: None)
    with pytest.raises(GraphError, match=r"\[SCH-4\] Probe 'p': attribute 'scale_value': expected a Float value, got nothing"):
        schema.bind_attributes({}, "p")
    assert schema.bind_attributes({"scale_value": 2}, "p") == {"scale_value": 2.0}


def test_builder_misuse_is_reported():
    b = geir.GraphBuilder("g")
    dy, cos, sin = _inputs(b)
    with pytest.raises(GraphError, match="input name 'dy' is already used"):
        b.input("dy", "float16", (1,))
    with pytest.raises(GraphError, match="input 'bad'.*unsupported dtype 'float128'"):
        b.input("bad", "float128", (1,))
    with pytest.raises(GraphError, match="input 0 'dy': expected a geir Value of graph 'g', got ndarray"):
        b.InplacePartialRotaryMulGrad(np.zeros((2, 4, 8, 64)), cos, sin)
    other = geir.GraphBuilder("other").input("dy", "float16", (2, 4, 8, 64))
    with pytest.raises(GraphError, match="belongs to another graph"):
        b.InplacePartialRotaryMulGrad(other, cos, sin)
    with pytest.raises(GraphError, match="no outputs"):
        b.build()
    y = b.InplacePartialRotaryMulGrad(dy, cos, sin, partial_slice=[0, 32], name="rope")
    with pytest.raises(GraphError, match="node name 'rope' is already used"):
        b.InplacePartialRotaryMulGrad(dy, cos, sin, partial_slice=[0, 32], name="rope")
    with pytest.raises(GraphError, match="a graph input keeps its name 'dy'"):
        b.output(dy, "renamed")
    b.output(y, "y")
    with pytest.raises(GraphError, match="already a graph output"):
        b.output(y)
    with pytest.raises(GraphError, match="output name 'cos' is already used"):
        b.output(b.InplacePartialRotaryMulGrad(dy, cos, sin, partial_slice=[0, 32]), "cos")
    b.build()
    with pytest.raises(GraphError, match="already built"):
        b.input("late", "float16", (1,))


def test_graph_text_topological_order_and_node_lookup():
    b = geir.GraphBuilder("chain")
    dy, cos, sin = _inputs(b, dtype="float32")
    y1 = b.InplacePartialRotaryMulGrad(dy, cos, sin, rotary_mode=1, partial_slice=[0, 32], name="first")
    y2 = b.InplacePartialRotaryMulGrad(y1, cos, sin, rotary_mode=1, partial_slice=[32, 64], name="second")
    b.output(y2, "out")
    b.declare_equal("S", "S2")
    g = b.build()
    text = str(g)
    assert text.startswith("graph chain(dy: float32[2,4,8,64], cos: float32[1,4,1,32], sin: float32[1,4,1,32]) {")
    assert "out = ai.cann::InplacePartialRotaryMulGrad(first.dy, cos, sin) {rotary_mode=1, partial_slice=[32,64]}" in text
    assert "return out: float32[2,4,8,64]" in text and "S == S2" in text
    assert [n.name for n in g.topological_order()] == ["first", "second"]
    assert g.node("second") is y2.producer
    with pytest.raises(KeyError, match="no node named 'third'"):
        g.node("third")
    assert [v.name for v in g.values()] == ["dy", "cos", "sin", "first.dy", "out"]


def test_topological_order_follows_dependencies_not_insertion():
    g = Graph("manual")
    t = TensorType("float32", (1, 1, 1, 4))
    x, c = Value("x", t), Value("c", t)
    g.inputs += [x, c]
    late = Node(ROPE_GRAD, [None, c, c], {}, [("y2", t)], name="late")
    early = Node(ROPE_GRAD, [x, c, c], {}, [("y1", t)], name="early")
    late.set_input(0, early.outputs[0])
    g.nodes += [late, early]
    assert [n.name for n in g.topological_order()] == ["early", "late"]
    assert x.uses == ((early, 0),) and early.outputs[0].uses == ((late, 0),)


def test_a_node_or_value_alone_is_not_shallow_copied():
    """Issue 23 item 10: a shallow copy of a node or value shares its use lists; copy the graph instead."""
    import copy

    b = geir.GraphBuilder("g")
    x = b.input("x", "float32", (4,))
    y = b.op("Relu", x, name="relu")
    b.output(y, "y")
    graph = b.build()
    with pytest.raises(GraphError, match="value 'x' cannot be copied on its own"):
        copy.copy(x)
    with pytest.raises(GraphError, match="Relu 'relu' cannot be copied on its own"):
        copy.copy(graph.node("relu"))
    twin = copy.copy(graph)
    assert twin.node("relu") is not graph.node("relu") and twin.inputs[0].uses[0][0] is twin.node("relu")


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_an_input_default_is_used_when_the_input_is_not_fed(runtime):
    """Issue 23 item 21: an input with an overridable default (an ONNX input with a same-name initializer)."""
    given = np.array([1, 2, 3], np.float32)
    b = geir.GraphBuilder("with_default")
    x = b.input("x", "float32", ("N",))
    w = b.input("w", "float32", ("N",), default=given)
    b.output(b.op("Mul", x, w), "y")
    graph = b.build()
    given[:] = 0                                    # the graph keeps its own copy, read-only
    assert not graph.defaults["w"].flags.writeable
    x_feed = np.array([2, 2, 2], np.float32)
    np.testing.assert_array_equal(geir.run(graph, {"x": x_feed}, runtime=runtime)["y"], [2, 4, 6])
    np.testing.assert_array_equal(geir.run(graph, {"x": x_feed, "w": x_feed}, runtime=runtime)["y"], [4, 4, 4])
    with pytest.raises(geir.ExecutionError, match=r"input 'w' \(its default\) dim 0: symbol 'N' is 3 here but 2"):
        geir.run(graph, {"x": np.ones(2, np.float32)}, runtime=runtime)
    with pytest.raises(GraphError, match="default for 'z': no graph input has that name"):
        graph.set_default("z", given)
    import copy
    import pickle

    for twin in (copy.copy(graph), pickle.loads(pickle.dumps(graph))):   # copies keep the default, read-only
        assert not twin.defaults["w"].flags.writeable and not np.shares_memory(twin.defaults["w"], graph.defaults["w"])
        np.testing.assert_array_equal(geir.run(twin, {"x": x_feed}, runtime=runtime)["y"], [2, 4, 6])
