"""Standard ONNX ops seen through ir/_standard.py: nodes that leave optional trailing outputs out, and pool sizes
with ceil_mode, each checked against ONNX's own backend node tests on both runtimes and through the export."""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import geir
from geir import ExecutionError, GraphError
from geir.ir import _standard

RUNTIMES = ("numpy", "onnxruntime")


def _node_cases(modules: tuple[str, ...]) -> dict[str, object]:
    """ONNX's backend node tests these case modules generate (the installed onnx wheel has no data/node files;
    the cases are made by the same ``expect`` calls that write them)."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in modules:
            importlib.import_module(f"onnx.backend.test.case.node.{module}")
    return {case.name: case for case in node._NodeTestCases}


BACKEND = (
    # BatchNormalization in inference mode (one output) and training mode (three)
    "test_batchnorm_example", "test_batchnorm_epsilon",
    "test_batchnorm_example_training_mode", "test_batchnorm_epsilon_training_mode",
    # Dropout without and with its mask
    "test_dropout_default", "test_dropout_default_ratio", "test_dropout_default_mask", "test_dropout_default_mask_ratio",
    "test_training_dropout_zero_ratio", "test_training_dropout_zero_ratio_mask",
    # LayerNormalization with Mean and InvStdDev
    "test_layer_normalization_2d_axis0", "test_layer_normalization_2d_axis1",
    "test_layer_normalization_2d_axis_negative_1",
    # MaxPool with and without Indices; pools with ceil_mode
    "test_maxpool_with_argmax_2d_precomputed_pads", "test_maxpool_with_argmax_2d_precomputed_strides",
    "test_maxpool_2d_pads", "test_maxpool_2d_ceil", "test_maxpool_2d_ceil_output_size_reduce_by_one",
    "test_averagepool_2d_ceil", "test_averagepool_2d_ceil_last_window_starts_on_pad",
)
"""Left out: the random training Dropouts (ONNX Runtime draws other masks than the recorded ones) and the
AveragePool dilations cases (AveragePool has ``dilations`` from opset 19; geir converts to 18)."""


@pytest.fixture(scope="module")
def cases() -> dict[str, object]:
    return _node_cases(("batch_normalization", "dropout", "layernormalization", "maxpool", "averagepool"))


@pytest.mark.parametrize("name", BACKEND)
def test_onnx_backend_node_case_runs_on_both_runtimes_and_exports(cases, name):
    case = cases[name]
    graph = geir.from_onnx(case.model)
    (inputs, expected), = case.data_sets[:1]
    feeds = {v.name: np.asarray(array) for v, array in zip(case.model.graph.input, inputs)}
    assert [tuple(v.type.shape) for v in graph.outputs] == [e.shape for e in expected]   # declared = returned
    for runtime in RUNTIMES:
        got = geir.run(graph, feeds, runtime=runtime)
        for value, want in zip(graph.outputs, expected):
            assert got[value.name].shape == want.shape, (runtime, value.name)
            np.testing.assert_allclose(got[value.name], want, rtol=case.rtol, atol=case.atol, err_msg=runtime)
    model = geir.to_onnx(graph)       # the exported model declares the shapes ONNX Runtime returns
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    declared = [tuple(d.dim_value for d in v.type.tensor_type.shape.dim) for v in model.graph.output]
    for array, want, shape in zip(session.run(None, feeds), expected, declared):
        assert array.shape == want.shape == shape
        np.testing.assert_allclose(array, want, rtol=case.rtol, atol=case.atol)


def _single_node_model(op: str, x_shape, outputs: list[str], opset: int, inputs=(), y_shape=None,
                       **attrs) -> onnx.ModelProto:
    names = ["x"] + [name for name, _ in inputs]
    graph = helper.make_graph(
        [helper.make_node(op, names, outputs, **attrs)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT if y_shape else TensorProto.UNDEFINED, y_shape)
         for o in outputs if o],
        initializer=[onnx.numpy_helper.from_array(a, n) for n, a in inputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _check_against_reference(model: onnx.ModelProto, x: np.ndarray, values: int = 99) -> geir.Graph:
    """Runs on both runtimes: every output of onnx.reference's shape, the first ``values`` of its values too (where
    the engines agree: ONNX Runtime and onnx.reference differ on MaxPool's Indices without strides and on LpPool's
    ceil_mode windows)."""
    graph = geir.from_onnx(model)
    want = ReferenceEvaluator(model).run(None, {"x": x})
    for runtime in RUNTIMES:
        got = geir.run(graph, {"x": x}, runtime=runtime)
        assert len(got) == len(want)
        for i, (value, w) in enumerate(zip(graph.outputs, want)):
            assert tuple(value.type.shape) == w.shape == got[value.name].shape
            if i < values:
                np.testing.assert_allclose(got[value.name], w, rtol=1e-5, atol=1e-5, err_msg=runtime)
    return graph


@pytest.mark.parametrize("opset", [15, 18])
def test_inference_batch_normalization_imports_and_runs(opset):
    """Was refused: ONNX's inference was asked for all 3 formal outputs, and inference mode has one."""
    rng = np.random.default_rng(0)
    params = [(n, rng.random(3, np.float32) + 0.5) for n in ("scale", "bias", "mean", "var")]
    model = _single_node_model("BatchNormalization", (2, 3, 4, 5), ["y"], opset, params, epsilon=1e-3)
    graph = _check_against_reference(model, rng.random((2, 3, 4, 5), np.float32))
    (node,) = graph.nodes
    assert len(node.outputs) == 1 and len(node.schema.outputs) == 1


def test_absent_trailing_outputs_written_as_empty_names_are_left_out():
    rng = np.random.default_rng(1)
    params = [(n, rng.random(3, np.float32) + 0.5) for n in ("scale", "bias", "mean", "var")]
    model = _single_node_model("BatchNormalization", (2, 3, 4), ["y", "", ""], 18, params, y_shape=[2, 3, 4])
    graph = _check_against_reference(model, rng.random((2, 3, 4), np.float32))
    assert [v.name for v in graph.outputs] == ["y"]


@pytest.mark.parametrize("op, outputs, attrs", [
    ("Dropout", ["y"], {}),
    ("Dropout", ["y", "mask"], {}),
    ("LayerNormalization", ["y"], {"axis": -1}),
    ("LayerNormalization", ["y", "mean"], {"axis": -1}),
    ("LayerNormalization", ["y", "mean", "inv_std"], {"axis": 1}),
    ("MaxPool", ["y"], {"kernel_shape": [2, 2]}),
    ("MaxPool", ["y", "indices"], {"kernel_shape": [2, 2]}),
])
def test_optional_trailing_outputs_infer_exactly_the_nodes_outputs(op, outputs, attrs):
    rng = np.random.default_rng(2)
    inputs = [("scale", rng.random(5, np.float32))] if op == "LayerNormalization" else []
    model = _single_node_model(op, (2, 3, 4, 5), outputs, 18, inputs, **attrs)
    graph = _check_against_reference(model, rng.random((2, 3, 4, 5), np.float32), 1 if op == "MaxPool" else 99)
    (node,) = graph.nodes
    assert len(node.outputs) == len(node.schema.outputs) == len(outputs)


def test_builder_leaves_optional_trailing_outputs_out():
    b = geir.GraphBuilder("bn")
    x = b.input("x", "float32", (2, 3, 4))
    params = [b.constant(n, np.full(3, 0.5, np.float32)) for n in ("s", "b", "m", "v")]
    with pytest.raises(GraphError, match="ONNX shape inference failed"):
        b.op("BatchNormalization", x, *params)          # all three outputs: training mode only
    y = b.op("BatchNormalization", x, *params, outputs=1, name="bn1")
    assert isinstance(y, geir.Value) and tuple(y.type.shape) == (2, 3, 4)
    with pytest.raises(GraphError, match="outputs=: expected 1 to 3"):
        b.op("BatchNormalization", x, *params, outputs=4)
    with pytest.raises(GraphError, match=r"outputs=: the op has a fixed number of outputs \(1\)"):
        b.op("Relu", x, outputs=2)


CEIL = [   # (input, kernel, strides, pads): the last two drop the window ONNX's opset-18 inference keeps
    ((1, 1, 4, 4), [3, 3], [2, 2], [0, 0, 0, 0]),
    ((1, 3, 32, 32), [3, 3], [2, 2], [1, 1, 1, 1]),
    ((1, 3, 2, 2), [3, 3], [3, 3], [1, 1, 1, 1]),
    ((1, 1, 2, 2), [1, 1], [2, 2], [0, 0, 0, 0]),
    ((1, 2, 5, 7), [2, 3], [3, 2], [1, 0, 1, 2]),
]


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
@pytest.mark.parametrize("shape, kernel, strides, pads", CEIL)
def test_ceil_mode_pool_shape_is_what_the_kernels_return(op, shape, kernel, strides, pads):
    """ONNX's rule: out = ceil((in + pads - ((k-1)*d+1)) / s) + 1, less the last window when it would start past the
    input and its left padding. onnx 1.23's inference for MaxPool-12 and AveragePool-11 (opset 18) misses the second
    half; onnx.reference and ONNX Runtime apply it."""
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads, "ceil_mode": 1}
    if op == "AveragePool":
        attrs["count_include_pad"] = 1
    x = np.random.default_rng(3).random(shape, np.float32)
    model = _single_node_model(op, shape, ["y"], 18, **attrs)
    graph = _check_against_reference(model, x, 0 if op == "LpPool" else 1)
    exported = geir.to_onnx(graph)
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    declared = tuple(d.dim_value for d in exported.graph.output[0].type.tensor_type.shape.dim)
    assert session.run(None, {"x": x})[0].shape == declared == tuple(graph.outputs[0].type.shape)


def test_a_result_that_disagrees_with_the_declared_shape_is_an_execution_error(monkeypatch):
    """Without the ceil_mode correction (as before), the declared shape is ONNX's [1,3,2,2]: both runtimes refuse the
    [1,3,1,1] their kernels return instead of handing it back under the wrong type."""
    monkeypatch.setattr(_standard, "_ceil_mode_pool_shapes", lambda op_type, ctx, out: out)
    monkeypatch.setattr(_standard, "export_attributes", lambda op_type, attributes, input_type: attributes)
    from geir.ir import _onnx_export
    monkeypatch.setattr(_onnx_export, "export_attributes", lambda op_type, attributes, input_type: attributes)
    model = _single_node_model("MaxPool", (1, 3, 2, 2), ["y"], 18, kernel_shape=[3, 3], strides=[3, 3],
                               pads=[1, 1, 1, 1], ceil_mode=1)
    graph = geir.from_onnx(model)
    assert tuple(graph.outputs[0].type.shape) == (1, 3, 2, 2)
    x = np.zeros((1, 3, 2, 2), np.float32)
    for runtime in RUNTIMES:
        with pytest.raises(ExecutionError, match=r"1, 3, 1, 1\].*'y'"):
            geir.run(graph, {"x": x}, runtime=runtime)
