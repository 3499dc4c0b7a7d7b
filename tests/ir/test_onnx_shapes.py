"""Shapes as the file and ONNX know them (issue 25, item 3): unnamed dims and unknown ranks are allowed for
standard ops and checked on the fed shapes at run time; our ops still need ranks and say so."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import geir
from geir import GraphError
from geir.ir._types import UnknownRankError

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, opset=21) -> onnx.ModelProto:
    return helper.make_model(helper.make_graph(nodes, "shapes", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", opset)])


def _both(graph, feeds) -> list[dict]:
    return [geir.run(graph, feeds, runtime=r) for r in ("numpy", "onnxruntime")]


def test_fed_axes_give_an_inner_value_of_unknown_rank_and_the_file_gives_the_outputs():
    """Unsqueeze's axes are a graph input: its output rank is known only once they are fed. The file declares the
    graph output's rank (ONNX files shape every graph output), which fills that gap for it."""
    model = _model([helper.make_node("Unsqueeze", ["x", "axes"], ["u"]), helper.make_node("Relu", ["u"], ["y"])],
                   [helper.make_tensor_value_info("x", F32, [2, 3]), helper.make_tensor_value_info("axes", I64, [1])],
                   [helper.make_tensor_value_info("y", F32, [None, None, None])])
    graph = geir.from_onnx(model)
    inner = next(n for n in graph.nodes if n.op_type == "Unsqueeze").outputs[0]
    assert not inner.type.has_rank and str(inner.type) == "float32[?]"
    assert graph.outputs[0].type.rank == 3
    x = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    for axes, shape in (([0], (1, 2, 3)), ([-1], (2, 3, 1))):
        for outs in _both(graph, {"x": x, "axes": np.array(axes, np.int64)}):
            np.testing.assert_array_equal(outs["y"], np.maximum(x, 0).reshape(shape))
    exported = geir.to_onnx(graph)
    assert not next(v for v in exported.graph.value_info if v.name == "u").type.tensor_type.HasField("shape")
    session = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x, "axes": np.array([1], np.int64)})[0],
                                  np.maximum(x, 0).reshape(2, 1, 3))


def test_the_files_static_sizes_fill_what_node_by_node_inference_cannot_know():
    """A Reshape whose target is computed from another value's Shape: ONNX's inference with data propagation over
    the whole file knows the target, inference of the node alone does not."""
    shape = helper.make_node("Shape", ["y"], ["target"])
    reshape = helper.make_node("Reshape", ["x", "target"], ["r"])
    model = _model([shape, reshape, helper.make_node("Relu", ["r"], ["out"])],
                   [helper.make_tensor_value_info("x", F32, [2, 6]), helper.make_tensor_value_info("y", F32, [3, 4])],
                   [helper.make_tensor_value_info("out", F32, [None, None])])
    graph = geir.from_onnx(model)
    assert next(n for n in graph.nodes if n.op_type == "Reshape").outputs[0].type.shape == (3, 4)
    assert graph.outputs[0].type.shape == (3, 4)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    for outs in _both(graph, {"x": x, "y": np.zeros((3, 4), np.float32)}):
        np.testing.assert_array_equal(outs["out"], x.reshape(3, 4))


def test_a_declared_size_is_checked_on_the_fed_shapes():
    """The file claims the symbolic output is 4 wide; a feed that makes it 5 is an ExecutionError, not a lie."""
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", F32, ["n"])],
                   [helper.make_tensor_value_info("y", F32, [4])])
    graph = geir.from_onnx(model)
    assert graph.outputs[0].type.shape == (4,)
    for runtime in ("numpy", "onnxruntime"):
        np.testing.assert_array_equal(geir.run(graph, {"x": -np.ones(4, np.float32)}, runtime=runtime)["y"], 0)
        with pytest.raises(geir.ExecutionError, match=r"'y'.*(expected|4)"):
            geir.run(graph, {"x": np.ones(5, np.float32)}, runtime=runtime)


def test_inputs_of_unknown_rank_and_unnamed_dims_take_any_size():
    b = geir.GraphBuilder("ranks")
    x = b.input("x", "float32", None)
    y = b.input("y", "float32", ("n", 4))
    b.output(b.op("Add", x, y), "z")
    built = b.build()
    model = _model([helper.make_node("Add", ["x", "y"], ["z"])],
                   [helper.make_tensor_value_info("x", F32, [None]), helper.make_tensor_value_info("y", F32, [None, 4])],
                   [helper.make_tensor_value_info("z", F32, [None, None])])
    imported = geir.from_onnx(model)
    assert isinstance(imported.inputs[1].type.shape[0], str) and not built.inputs[0].type.has_rank
    for graph in (built, imported):
        for x_shape, y_shape in (((4,), (3, 4)), ((1,), (5, 4))):
            x = np.ones(x_shape, np.float32)
            y = np.arange(np.prod(y_shape), dtype=np.float32).reshape(y_shape)
            for outs in _both(graph, {"x": x, "y": y}):
                np.testing.assert_array_equal(outs["z"], x + y)
        with pytest.raises(geir.ExecutionError, match=r"input 'y': expected rank 2"):
            geir.run(graph, {"x": np.ones(4, np.float32), "y": np.ones(4, np.float32)}, runtime="numpy")
        with pytest.raises(geir.ExecutionError, match=r"input 'y' dim 1: expected 4, got 5"):
            geir.run(graph, {"x": np.ones(4, np.float32), "y": np.ones((1, 5), np.float32)}, runtime="onnxruntime")
    with pytest.raises(GraphError, match=r"cannot export: ONNX files give every graph input and output a shape, and "
                                         r"input 'x', output 'z' have an unknown rank"):
        geir.to_onnx(built)


def test_our_ops_refuse_an_input_of_unknown_rank_naming_it():
    b = geir.GraphBuilder("rank")
    x = b.input("x", "float16", None)
    cos = b.input("cos", "float16", (1, 4, 1, 8))
    with pytest.raises(GraphError, match=r"InplacePartialRotaryMul '.*': input 'x': expected a known rank .* got "
                                         r"float16\[\?\]"):
        b.InplacePartialRotaryMul(x, cos, cos, rotary_mode=1, partial_slice=[0, 8])


def test_a_shape_asked_of_an_unknown_rank_is_an_error_never_a_wrong_shape():
    t = geir.TensorType("float32", None)
    assert not t.has_rank and not t.is_static and t.dims is None
    with pytest.raises(UnknownRankError, match="unknown rank has no shape"):
        t.shape
    with pytest.raises(GraphError):
        t.rank
