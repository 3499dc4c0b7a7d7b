"""ONNX import: round trips of every op, models mixing standard ops with ours, and bad files."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import geir
from geir import GraphError
from geir.schemas import OPSET
from helpers import assert_same_graph
from moe.helpers import moe_grad_graph, moe_graph
from oracles.onnx_runners import run_onnxruntime
from rotary.helpers import ROPE, ROPE_GRAD, rotary_graph
from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase, sfa_graph


def _graphs():
    yield rotary_graph(ROPE, (2, "S", 4, 16), (1, "S", 1, 8), "bfloat16", "float32", rotary_mode=3, partial_slice=[3, 11])
    yield rotary_graph(ROPE_GRAD, (2, 3, 4, 16), (2, 1, 4, 16), "float16", rotary_mode=2, partial_slice=[0, 16])
    yield moe_graph(6, 4, 6, (3, 2), "bfloat16", "float16")
    yield moe_graph(6, 4, 8)
    yield moe_grad_graph((6, 4), (3, 4), 6, (3, 2), "float32", "bfloat16")
    yield moe_grad_graph(None, (6, 4), 6, None, "float16")
    for case in (AttentionCase(Dr=4, sinks=True, lengths=True), AttentionCase(layout="TND", N2=2, N1=4, kv_merge=True)):
        a = case.arrays()
        value = a["value"] if a["value"] is not None else a["key"][..., :case.D2]
        yield sfa_graph(dict(a, value=value), SFA, **case.forward_attrs())[0]
        grad = {"query": a["query"], "key": a["key"], "sparse_indices": a["sparse_indices"],
                "d_out": np.zeros(a["query"].shape[:-1] + (case.D2,), a["query"].dtype),
                "out": np.zeros(a["query"].shape[:-1] + (case.D2,), a["query"].dtype),
                "softmax_max": np.zeros((2, case.N2, 5, 4 // case.N2) if case.layout == "BSND" else
                                        (case.N2, a["query"].shape[0], case.N1 // case.N2), np.float32),
                "value": a["value"], "query_rope": a["query_rope"], "key_rope": a["key_rope"]}
        grad["softmax_sum"] = grad["softmax_max"]
        if case.layout == "TND":
            grad |= {k: a[k] for k in ("actual_seq_lengths_query", "actual_seq_lengths_kv")}
        yield sfa_graph(grad, SFA_GRAD, **case.grad_attrs())[0]


@pytest.mark.parametrize("graph", list(_graphs()), ids=lambda g: g.nodes[0].op_type)
def test_round_trip_every_op(graph):
    assert_same_graph(geir.from_onnx(geir.to_onnx(graph)), graph)


def test_round_trip_keeps_scale_value_as_float32():
    c = AttentionCase()
    g, _ = sfa_graph(c.arrays(), SFA, **dict(c.forward_attrs(), scale_value=0.044194))
    assert g.nodes[0].attributes["scale_value"] == float(np.float32(0.044194))
    assert geir.from_onnx(geir.to_onnx(g)).nodes[0].attributes["scale_value"] == g.nodes[0].attributes["scale_value"]


def _mixed_model() -> onnx.ModelProto:
    """Transpose -> InplacePartialRotaryMulGrad (ours) -> Add (initializer) -> Cast, built by hand with onnx.helper."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1, 3], name="to_bsnd"),
        helper.make_node(ROPE_GRAD, ["xt", "cos", "sin"], ["dx"], domain="ai.cann", name="rope", rotary_mode=1,
                         partial_slice=[0, 8]),
        helper.make_node("Add", ["dx", "bias"], ["shifted"], name="shift"),
        helper.make_node("Cast", ["shifted"], ["out"], to=TensorProto.FLOAT, name="widen"),
    ]
    graph = helper.make_graph(
        nodes, "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 2, "S", 8]),
         helper.make_tensor_value_info("cos", TensorProto.FLOAT16, [1, "S", 1, 8]),
         helper.make_tensor_value_info("sin", TensorProto.FLOAT16, [1, "S", 1, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "S", 2, 8])],
        initializer=[numpy_helper.from_array(np.full((8,), 0.5, np.float16), "bias")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.cann", 1)])


def test_import_a_model_mixing_standard_ops_and_ours():
    g = geir.from_onnx(_mixed_model())
    assert [(n.domain, n.op_type) for n in g.nodes] == [("", "Transpose"), ("ai.cann", ROPE_GRAD), ("", "Add"),
                                                       ("", "Cast")]
    assert g.outputs[0].type == geir.TensorType("float32", (1, "S", 2, 8)) and "bias" in g.constants
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 2, 3, 8)).astype(np.float16),
             "cos": rng.uniform(-1, 1, (1, 3, 1, 8)).astype(np.float16),
             "sin": rng.uniform(-1, 1, (1, 3, 1, 8)).astype(np.float16)}
    before = {k: v.copy() for k, v in feeds.items()}
    out = geir.run(g, feeds)["out"]
    # Transpose's reference kernel returns a view of x; the in-place rotary must not write through it
    assert all(np.array_equal(before[k], feeds[k]) for k in feeds)
    from geir.runtimes.numpy.rotary import rotary_mul_grad
    expected = (rotary_mul_grad(feeds["x"].transpose(0, 2, 1, 3), feeds["cos"], feeds["sin"], rotary_mode=1,
                                partial_slice=(0, 8)) + np.float16(0.5)).astype(np.float32)
    np.testing.assert_array_equal(out, expected)
    # exported again, it runs in ONNX Runtime with our function body; ORT's CPU provider has no float16
    # Add and removes the float16 round trip around it, so allow one float16 unit at the output's scale
    from oracles.numerics import assert_within_ulps_of_scale
    assert_within_ulps_of_scale(run_onnxruntime(geir.to_onnx(g), feeds)["out"].astype(np.float16), out.astype(np.float64),
                                np.float16, ulps=1)


def test_standard_ops_built_by_the_builder():
    b = geir.GraphBuilder("std")
    x = b.input("x", "bfloat16", (2, 3))
    y = b.op("Mul", x, b.constant("two", np.full((3,), 2, ml_dtypes.bfloat16)))
    b.output(b.op("Softmax", b.op("Cast", y, to=TensorProto.FLOAT), axis=-1), "p")
    g = b.build()
    x_val = np.array([[0, 1, 2], [3, 4, 5]], ml_dtypes.bfloat16)
    p = geir.run(g, {"x": x_val})["p"]
    e = np.exp(2.0 * np.arange(6).reshape(2, 3))
    np.testing.assert_allclose(p, e / e.sum(-1, keepdims=True), rtol=1e-6)
    assert_same_graph(geir.from_onnx(geir.to_onnx(g)), g)


def _model_with(node: onnx.NodeProto, inputs, outputs, functions=()) -> onnx.ModelProto:
    graph = helper.make_graph([node] if not isinstance(node, list) else node, "bad", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.cann", 1)],
                             functions=list(functions))


F16 = TensorProto.FLOAT16


def _vi(name, dtype=F16, shape=(1, 1, 1, 8)):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def test_bad_files_give_graph_errors():
    with pytest.raises(GraphError, match=r"\[SCH-1\] Rotate 'n': op type: expected an op of domain 'ai.cann'"):
        geir.from_onnx(_model_with(helper.make_node("Rotate", ["x"], ["y"], domain="ai.cann", name="n"),
                                   [_vi("x")], [_vi("y")]))
    with pytest.raises(GraphError, match=r"Rotate 'n': the model imports no opset of its domain 'com.acme'"):
        geir.from_onnx(_model_with(helper.make_node("Rotate", ["x"], ["y"], domain="com.acme", name="n"),
                                   [_vi("x")], [_vi("y")]))
    c = AttentionCase()
    a = c.arrays()
    vis = [_vi(k, F16 if v.dtype == np.float16 else TensorProto.INT32, v.shape)
           for k, v in a.items() if v is not None and k in ("query", "key", "value", "sparse_indices")]
    no_scale = helper.make_node(SFA, ["query", "key", "value", "sparse_indices"], ["o", "m", "s"], domain="ai.cann",
                                name="attn")
    with pytest.raises(GraphError, match=r"\[SCH-4\] SparseFlashAttention 'attn': attribute 'scale_value'"):
        geir.from_onnx(_model_with(no_scale, vis, [_vi("o", F16, (2, 5, 4, 8))]))
    wrong = helper.make_node(ROPE_GRAD, ["x", "c", "c"], ["y"], domain="ai.cann", name="r", partial_slice=[0, 8])
    with pytest.raises(GraphError, match=r"\[SCH-5\] InplacePartialRotaryMulGrad 'r': input 1 'cos': expected dtype"):
        geir.from_onnx(_model_with(wrong, [_vi("x"), _vi("c", TensorProto.INT32)], [_vi("y")]))
    kind = helper.make_node(ROPE_GRAD, ["x", "x", "x"], ["y"], domain="ai.cann", name="r", rotary_mode=1.5,
                            partial_slice=[0, 8])
    with pytest.raises(GraphError, match=r"\[SCH-3\] .*attribute 'rotary_mode': expected kind Int, got 1.5"):
        geir.from_onnx(_model_with(kind, [_vi("x")], [_vi("y")]))
    cycle = [helper.make_node("Relu", ["b"], ["a"], name="first"), helper.make_node("Relu", ["a"], ["b"], name="second")]
    with pytest.raises(GraphError, match=r"graph 'bad' has a cycle: 'first' -> 'second' -> 'first'|has a cycle: "
                                         r"'second' -> 'first' -> 'second'"):
        geir.from_onnx(_model_with(cycle, [_vi("x")], [_vi("a")]))
    dangling = helper.make_node("Relu", ["nowhere"], ["y"], name="relu")
    with pytest.raises(GraphError, match=r"Relu 'relu': input 'nowhere' is no graph input"):
        geir.from_onnx(_model_with(dangling, [_vi("x")], [_vi("y")]))
    with pytest.raises(GraphError, match=r"graph input 'x': element type 99 \(unknown to onnx\) is not one of geir's"):
        geir.from_onnx(_model_with(helper.make_node("Relu", ["x"], ["y"]), [_vi("x", 99)], [_vi("y")]))


def test_user_local_functions_are_inlined_and_ours_dropped():
    double = helper.make_function("com.user", "Double", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                                  [helper.make_opsetid("", 18)])
    nodes = [helper.make_node("Double", ["x"], ["y"], domain="com.user", name="d")]
    graph = helper.make_graph(nodes, "fn", [_vi("x", TensorProto.FLOAT, (2,))], [_vi("y", TensorProto.FLOAT, (2,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.user", 1)],
                              functions=[double])
    g = geir.from_onnx(model)
    assert [n.op_type for n in g.nodes] == ["Add"]
    assert geir.run(g, {"x": np.array([1, 2], np.float32)})["y"].tolist() == [2, 4]
    exported = geir.to_onnx(rotary_graph(ROPE_GRAD, (1, 1, 1, 8), (1, 1, 1, 8), partial_slice=[0, 8]))
    assert len(exported.functions) == 1 and len(geir.from_onnx(exported).nodes) == 1


def _input_with_initializer(ir_version: int, default: np.ndarray | None = None, opset: int = 17) -> onnx.ModelProto:
    """y = x + w, where w is a graph input with a same-name initializer (IR >= 4: an overridable default)."""
    default = np.array([10, 20, 30], np.float32) if default is None else default
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("x", "w", "y")]
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "defaults", vi[:2], vi[2:],
                              initializer=[numpy_helper.from_array(default, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_an_input_with_an_initializer_is_an_input_with_a_default(runtime):
    """Issue 23 item 21: it was imported as a constant, so feeding it failed where ONNX Runtime accepts the feed."""
    model = _input_with_initializer(ir_version=8)
    x, w = np.array([1, 2, 3], np.float32), np.array([-1, -2, 5], np.float32)
    graph = geir.from_onnx(model)
    assert [v.name for v in graph.inputs] == ["x", "w"] and not graph.constants
    for g in (graph, geir.from_onnx(geir.to_onnx(graph)), geir.GraphBuilder.copy(graph).build()):
        np.testing.assert_array_equal(geir.run(g, {"x": x}, runtime=runtime)["y"], [11, 22, 33])
        np.testing.assert_array_equal(geir.run(g, {"x": x, "w": w}, runtime=runtime)["y"], x + w)
        assert geir.to_onnx(g).graph.initializer[0].name == "w"
        assert [i.name for i in geir.to_onnx(g).graph.input] == ["x", "w"]
    np.testing.assert_array_equal(run_onnxruntime(model, {"x": x, "w": w})["y"], x + w)   # ONNX Runtime's meaning


def test_an_old_model_keeps_its_initializer_inputs_constant_and_a_bad_default_is_refused():
    graph = geir.from_onnx(_input_with_initializer(ir_version=3))     # IR < 4: initializers are not overridable
    assert [v.name for v in graph.inputs] == ["x"] and set(graph.constants) == {"w"}
    with pytest.raises(GraphError, match=r"default of input 'w': expected dtype float32, got float64"):
        geir.from_onnx(_input_with_initializer(ir_version=8, default=np.zeros(3), opset=OPSET))
    with pytest.raises(GraphError, match=r"default of input 'w': expected shape \[3\], got \[2\]"):
        geir.from_onnx(_input_with_initializer(ir_version=8, default=np.zeros(2, np.float32), opset=OPSET))


@pytest.mark.parametrize("opset", [18, 20])
def test_a_type_an_older_opset_lacks_names_the_opset_that_takes_it(opset):
    """torch's dynamo exporter writes a bfloat16 ConstantOfShape at opset 18, which ONNX allows from opset 20 only:
    refused with the opset to export at; at opset 20 the same model imports."""
    fill = numpy_helper.from_array(np.ones(1, ml_dtypes.bfloat16), "value")
    node = helper.make_node("ConstantOfShape", ["shape"], ["y"], value=fill)
    graph = helper.make_graph([node], "bf16_fill", [helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["a", "b"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if opset == 20:
        assert geir.from_onnx(model).outputs[0].type.dtype.value == "bfloat16"
        return
    with pytest.raises(geir.GraphError, match=r"takes tensor\(bfloat16\) from opset 20, this node's opset is 18"):
        geir.from_onnx(model)
