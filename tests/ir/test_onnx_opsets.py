"""Imported models keep their standard opset (issue 25, item 1): every standard node follows its model's opset
(``Node.version``), runs at it on both runtimes, and exports at it; only where one model cannot hold two
definitions (a node of an older opset beside newer ones, or beside our ops' opset-18 bodies) or where an engine
runs only the newer meaning is a node lifted by onnx's version converter."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import geir
from geir import GraphError
from geir.ir._registry import get_schema

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, opset, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "opsets", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _plain_ort(model: onnx.ModelProto, feeds: dict) -> list:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _rms_model(opset: int = 23) -> onnx.ModelProto:
    """RMSNormalization (new in opset 23) feeding Gelu (new in 20): no opset-18 version of either exists."""
    nodes = [helper.make_node("RMSNormalization", ["x", "scale"], ["n"], axis=-1, epsilon=1e-5, name="rms"),
             helper.make_node("Gelu", ["n"], ["y"], approximate="tanh", name="gelu")]
    scale = numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(np.float32), "scale")
    return _model(nodes, [helper.make_tensor_value_info("x", F32, [2, 3, 8])],
                  [helper.make_tensor_value_info("y", F32, [2, 3, 8])], opset, [scale])


def test_ops_newer_than_opset_18_import_run_and_export_at_their_opset():
    model = _rms_model()
    graph = geir.from_onnx(model)
    assert [(n.op_type, n.version) for n in graph.nodes] == [("RMSNormalization", 23), ("Gelu", 23)]
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    for runtime in ("numpy", "onnxruntime"):
        np.testing.assert_allclose(geir.run(graph, {"x": x}, runtime=runtime)["y"], expected, rtol=1e-5, atol=1e-6)
    exported = geir.to_onnx(graph)
    assert {o.domain: o.version for o in exported.opset_import} == {"": 23}
    np.testing.assert_allclose(_plain_ort(exported, {"x": x})[0], expected, rtol=1e-5, atol=1e-6)


def test_an_old_opset_is_kept_and_run_with_its_own_meaning():
    """Opset-11 Softmax over axis 1 normalises the flattened axes 1 and 2: onnx.reference runs only opset 13's
    meaning, so the NumPy runtime lifts that node; ONNX Runtime and the export keep opset 11."""
    model = _model([helper.make_node("Softmax", ["x"], ["y"], axis=1, name="softmax")],
                   [helper.make_tensor_value_info("x", F32, [2, 3, 4])], [helper.make_tensor_value_info("y", F32,
                                                                                             [2, 3, 4])], 11)
    graph = geir.from_onnx(model)
    assert graph.nodes[0].version == 11
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    flat = x.reshape(2, 12)
    expected = (np.exp(flat - flat.max(1, keepdims=True)) / np.exp(flat - flat.max(1, keepdims=True)).sum(
        1, keepdims=True)).reshape(2, 3, 4)
    for runtime in ("numpy", "onnxruntime"):
        np.testing.assert_allclose(geir.run(graph, {"x": x}, runtime=runtime)["y"], expected, rtol=1e-5)
    exported = geir.to_onnx(graph)
    assert exported.opset_import[0].version == 11
    np.testing.assert_allclose(_plain_ort(exported, {"x": x})[0], expected, rtol=1e-5)


def test_a_node_of_an_older_opset_beside_newer_ones_is_lifted_on_export():
    """An opset-17 model (ReduceMax's axes an attribute) gets an opset-18 ReduceMax (axes an input) from the
    builder: the export is at 18 and carries the old node in its opset-18 form."""
    model = _model([helper.make_node("ReduceMax", ["x"], ["m"], axes=[1], keepdims=0, name="rowmax")],
                   [helper.make_tensor_value_info("x", F32, [4, 5])], [helper.make_tensor_value_info("m", F32, [4])],
                   17)
    imported = geir.from_onnx(model)
    b = geir.GraphBuilder("mixed")
    m = b.copy_from(imported)[id(imported.outputs[0])]
    total = b.op("ReduceMax", m, b.constant("axis0", np.array([0], np.int64)), keepdims=0)
    b.output(total, "top")
    graph = b.build()
    assert sorted(n.version for n in graph.nodes) == [17, 18]
    x = np.random.default_rng(2).standard_normal((4, 5)).astype(np.float32)
    for runtime in ("numpy", "onnxruntime"):
        outs = geir.run(graph, {"x": x}, runtime=runtime)
        np.testing.assert_array_equal(outs["m"], x.max(1))
        np.testing.assert_array_equal(outs["top"], x.max())
    exported = geir.to_onnx(graph)
    assert exported.opset_import[0].version == 18
    rowmax = next(n for n in exported.graph.node if n.name == "rowmax")
    assert len(rowmax.input) == 2 and not rowmax.attribute[0].name == "axes"
    np.testing.assert_array_equal(_plain_ort(exported, {"x": x})[0], x.max(1))
    assert {n.version for n in geir.from_onnx(exported).nodes} == {18}


def _rope_graph(opset_of_model: int) -> tuple[onnx.ModelProto, dict]:
    """Our rotary op behind a standard Relu, in a model of standard opset ``opset_of_model``."""
    b = geir.GraphBuilder("rope")
    x = b.input("x", "float32", (1, 4, 2, 8))
    cos = b.input("cos", "float32", (1, 4, 1, 8))
    sin = b.input("sin", "float32", (1, 4, 1, 8))
    b.output(b.op("Relu", b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=1, partial_slice=[0, 8])), "y")
    model = geir.to_onnx(b.build())
    model.opset_import[0].version = opset_of_model
    del model.functions[:]     # a file may leave our ops' bodies out (import drops them anyway)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((1, 4, 2, 8)).astype(np.float32),
             "cos": rng.standard_normal((1, 4, 1, 8)).astype(np.float32),
             "sin": rng.standard_normal((1, 4, 1, 8)).astype(np.float32)}
    return model, feeds


@pytest.mark.parametrize("opset", [14, 21])
def test_our_ops_bodies_are_written_at_the_models_opset_and_at_least_18(opset):
    model, feeds = _rope_graph(opset)
    graph = geir.from_onnx(model)
    assert next(n for n in graph.nodes if n.op_type == "Relu").version == opset
    exported = geir.to_onnx(graph)
    written = max(opset, 18)
    assert {o.domain: o.version for o in exported.opset_import}[""] == written
    assert all(f.opset_import[0].version == written for f in exported.functions)
    expected = geir.run(graph, feeds, runtime="numpy")["y"]
    np.testing.assert_allclose(geir.run(graph, feeds, runtime="onnxruntime")["y"], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_plain_ort(exported, feeds)[0], expected, rtol=1e-5, atol=1e-6)


def test_an_op_the_models_opset_does_not_have_is_refused_naming_the_opset():
    model = _model([helper.make_node("Gelu", ["x"], ["y"], name="gelu")], [helper.make_tensor_value_info("x", F32, [3])],
                   [helper.make_tensor_value_info("y", F32, [3])], 18)
    with pytest.raises(GraphError, match="opset 18"):
        geir.from_onnx(model)
    with pytest.raises(GraphError, match=r"opset: expected a standard opset onnx .* knows \(1 to \d+\), got 99"):
        get_schema("Relu", "", version=99)


def test_a_batched_scan_8_is_refused_on_numpy_and_runs_on_onnxruntime():
    """Scan-8 scans a batch axis first; onnx.reference runs Scan-9's meaning and the converter drops the batch
    axis, so the NumPy runtime refuses the node instead of computing something else."""
    body = helper.make_graph([helper.make_node("Add", ["s", "x"], ["s2"]), helper.make_node("Identity", ["s2"], ["o"])],
                             "body", [helper.make_tensor_value_info("s", F32, [2]),
                                      helper.make_tensor_value_info("x", F32, [2])],
                             [helper.make_tensor_value_info("s2", F32, [2]), helper.make_tensor_value_info("o", F32, [2])])
    scan = helper.make_node("Scan", ["", "init", "xs"], ["final", "all"], body=body, num_scan_inputs=1, name="scan")
    model = _model([scan], [helper.make_tensor_value_info("init", F32, [1, 2]),
                            helper.make_tensor_value_info("xs", F32, [1, 3, 2])],
                   [helper.make_tensor_value_info("final", F32, [1, 2]),
                    helper.make_tensor_value_info("all", F32, [1, 3, 2])], 8)
    graph = geir.from_onnx(model)
    feeds = {"init": np.zeros((1, 2), np.float32), "xs": np.arange(6, dtype=np.float32).reshape(1, 3, 2)}
    with pytest.raises(GraphError, match="Scan of opset 8 is not run by onnx.reference"):
        geir.run(graph, feeds, runtime="numpy")
    outs = geir.run(graph, feeds, runtime="onnxruntime")
    np.testing.assert_array_equal(outs["final"], [[6.0, 9.0]])
    np.testing.assert_array_equal(outs["all"], np.cumsum(feeds["xs"], axis=1))
