"""Ops of other domains the engines implement (issue 25, item 4): ONNX's ``ai.onnx.ml`` and
``ai.onnx.preview.training`` (declared by onnx.defs: checked and inferred as standard ops are) and ONNX Runtime's
``com.microsoft`` contrib ops (known to geir only by the types the file declares) import, run on the runtime
whose engine has them, export, and give a clear error on the other runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import geir
from geir import GraphError

F32 = TensorProto.FLOAT


def _plain_ort(model: onnx.ModelProto, feeds: dict) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_ai_onnx_ml_ops_run_on_both_runtimes_and_export_with_their_opset():
    nodes = [helper.make_node("Binarizer", ["x"], ["b"], domain="ai.onnx.ml", threshold=0.5, name="bin"),
             helper.make_node("Scaler", ["b"], ["y"], domain="ai.onnx.ml", offset=[0.5], scale=[4.0], name="scale")]
    model = helper.make_model(helper.make_graph(nodes, "ml", [helper.make_tensor_value_info("x", F32, [2, 3])],
                                                [helper.make_tensor_value_info("y", F32, [2, 3])]),
                              opset_imports=[helper.make_opsetid("ai.onnx.ml", 3)])   # no default domain at all
    graph = geir.from_onnx(model)
    assert [(n.domain, n.version) for n in graph.nodes] == [("ai.onnx.ml", 3)] * 2
    x = np.array([[0.1, 0.7, 0.5], [0.9, 0.2, 0.6]], np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(expected, ((x > 0.5) - 0.5) * 4.0)
    for runtime in ("numpy", "onnxruntime"):
        np.testing.assert_array_equal(geir.run(graph, {"x": x}, runtime=runtime)["y"], expected)
    exported = geir.to_onnx(graph)
    assert {o.domain: o.version for o in exported.opset_import}["ai.onnx.ml"] == 3
    np.testing.assert_array_equal(_plain_ort(exported, {"x": x})[0], expected)


def test_an_ml_op_is_checked_as_onnx_declares_it():
    node = helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml", threshold="high", name="bin")
    model = helper.make_model(helper.make_graph([node], "ml", [helper.make_tensor_value_info("x", F32, [2])],
                                                [helper.make_tensor_value_info("y", F32, [2])]),
                              opset_imports=[helper.make_opsetid("ai.onnx.ml", 3), helper.make_opsetid("", 21)])
    with pytest.raises(GraphError, match="threshold"):
        geir.from_onnx(model)


def _skip_layer_norm_model(declare_output: bool = True) -> onnx.ModelProto:
    """SkipLayerNormalization as ONNX Runtime's transformer optimizer writes it (domain com.microsoft)."""
    node = helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y"], domain="com.microsoft",
                            epsilon=1e-5, name="skip_ln")
    relu = helper.make_node("Relu", ["y"], ["out"], name="relu")
    weights = [numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(np.float32), "gamma"),
               numpy_helper.from_array(np.linspace(-0.1, 0.1, 8).astype(np.float32), "beta")]
    value_info = [helper.make_tensor_value_info("y", F32, [2, 4, 8])] if declare_output else []
    graph = helper.make_graph([node, relu], "contrib", [helper.make_tensor_value_info(n, F32, [2, 4, 8])
                                                        for n in ("x", "skip")],
                              [helper.make_tensor_value_info("out", F32, [2, 4, 8])], initializer=weights,
                              value_info=value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def test_contrib_ops_run_on_onnxruntime_and_numpy_says_it_has_no_kernel():
    model = _skip_layer_norm_model()
    graph = geir.from_onnx(model)
    node = next(n for n in graph.nodes if n.domain == "com.microsoft")
    assert node.outputs[0].type.shape == (2, 4, 8) and node.attributes["epsilon"] == pytest.approx(1e-5)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 4, 8)).astype(np.float32),
             "skip": rng.standard_normal((2, 4, 8)).astype(np.float32)}
    total = (feeds["x"] + feeds["skip"]).astype(np.float64)
    normal = (total - total.mean(-1, keepdims=True)) / np.sqrt(total.var(-1, keepdims=True) + 1e-5)
    expected = np.maximum(normal * np.linspace(0.5, 1.5, 8) + np.linspace(-0.1, 0.1, 8), 0)
    np.testing.assert_allclose(geir.run(graph, feeds, runtime="onnxruntime")["out"], expected, atol=2e-6)
    np.testing.assert_allclose(_plain_ort(geir.to_onnx(graph), feeds)[0], expected, atol=2e-6)
    with pytest.raises(GraphError, match=r"runtime 'numpy' has no kernel for com.microsoft::SkipLayerNormalization"):
        geir.run(graph, feeds, runtime="numpy")


def test_a_contrib_op_whose_output_the_file_leaves_untyped_is_refused_naming_it():
    with pytest.raises(GraphError, match=r"com.microsoft::SkipLayerNormalization 'skip_ln': output 0: geir neither "
                                         r"declares nor infers ops of domain 'com.microsoft'"):
        geir.from_onnx(_skip_layer_norm_model(declare_output=False))


def test_preview_training_ops_run_where_onnx_reference_has_them():
    """Adagrad (ai.onnx.preview.training) runs on onnx.reference; ONNX Runtime's CPU build has no kernel."""
    inputs = [helper.make_tensor_value_info(n, F32, s) for n, s in (("r", []), ("t", []), ("x", [3]), ("g", [3]),
                                                                    ("h", [3]))]
    inputs[1] = helper.make_tensor_value_info("t", TensorProto.INT64, [])
    node = helper.make_node("Adagrad", ["r", "t", "x", "g", "h"], ["x_new", "h_new"],
                            domain="ai.onnx.preview.training", decay_factor=0.1, epsilon=1e-5, norm_coefficient=0.01)
    model = helper.make_model(helper.make_graph([node], "train", inputs, [helper.make_tensor_value_info(n, F32, [3])
                                                                        for n in ("x_new", "h_new")]),
                              opset_imports=[helper.make_opsetid("", 21),
                                             helper.make_opsetid("ai.onnx.preview.training", 1)])
    feeds = {"r": np.array(0.1, np.float32), "t": np.array(0, np.int64), "x": np.array([1.0, 2.0, 3.0], np.float32),
             "g": np.array([-1.0, 0.5, 0.0], np.float32), "h": np.array([2.0, 1.0, 0.5], np.float32)}
    graph = geir.from_onnx(model)
    got = geir.run(graph, feeds, runtime="numpy")
    for name, want in zip(("x_new", "h_new"), ReferenceEvaluator(model).run(None, feeds)):
        np.testing.assert_array_equal(got[name], want)
    with pytest.raises(GraphError, match="runtime 'onnxruntime' cannot run graph 'train'"):
        geir.run(graph, feeds, runtime="onnxruntime")
