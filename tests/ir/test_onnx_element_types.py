"""Every ONNX element type through standard ops (issue 25, item 2): imported, run on both runtimes and exported,
against onnx.reference on the original model. Our ops keep CANN's dtypes (their schemas' tests)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import geir
from geir import GraphError

T = TensorProto


def _model(node: onnx.NodeProto, inputs: dict[str, int], output: int) -> onnx.ModelProto:
    graph = helper.make_graph([node], "types", [helper.make_tensor_value_info(n, t, [3]) for n, t in inputs.items()],
                              [helper.make_tensor_value_info(node.output[0], output, [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


_RNG = np.random.default_rng(0)
CASES = {
    "float64": (helper.make_node("Add", ["a", "b"], ["y"]), {"a": T.DOUBLE, "b": T.DOUBLE}, T.DOUBLE,
                {"a": _RNG.standard_normal(3), "b": _RNG.standard_normal(3)}),
    "uint8": (helper.make_node("BitShift", ["a", "b"], ["y"], direction="LEFT"), {"a": T.UINT8, "b": T.UINT8}, T.UINT8,
              {"a": np.array([1, 127, 255], np.uint8), "b": np.array([1, 1, 3], np.uint8)}),
    "int16": (helper.make_node("Mul", ["a", "b"], ["y"]), {"a": T.INT16, "b": T.INT16}, T.INT16,
              {"a": np.array([300, -2, 7], np.int16), "b": np.array([300, 9, -7], np.int16)}),
    "uint64": (helper.make_node("Max", ["a", "b"], ["y"]), {"a": T.UINT64, "b": T.UINT64}, T.UINT64,
               {"a": np.array([2**63, 1, 0], np.uint64), "b": np.array([1, 2**64 - 1, 0], np.uint64)}),
    "int8": (helper.make_node("Neg", ["a"], ["y"]), {"a": T.INT8}, T.INT8, {"a": np.array([-128, 5, 127], np.int8)}),
    "string": (helper.make_node("StringConcat", ["a", "b"], ["y"]), {"a": T.STRING, "b": T.STRING}, T.STRING,
               {"a": np.array(["ab", "", "é"], dtype=object), "b": np.array(["c", "d", "ü"], dtype=object)}),
    "float8_e4m3fn": (helper.make_node("Cast", ["a"], ["y"], to=T.FLOAT8E4M3FN), {"a": T.FLOAT}, T.FLOAT8E4M3FN,
                      {"a": np.array([0.3, -1.7, 1000.0], np.float32)}),
    "float8_e5m2_in": (helper.make_node("Cast", ["a"], ["y"], to=T.FLOAT), {"a": T.FLOAT8E5M2}, T.FLOAT,
                       {"a": np.array([0.25, -3.0, 57344.0], ml_dtypes.float8_e5m2)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_standard_ops_of_every_element_type_match_onnx_reference(case):
    node, inputs, output, feeds = CASES[case]
    model = _model(node, inputs, output)
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    graph = geir.from_onnx(model)
    assert graph.outputs[0].dtype.onnx == output
    for runtime in ("numpy", "onnxruntime"):
        got = geir.run(graph, feeds, runtime=runtime)["y"]
        assert got.dtype == geir.DType(graph.outputs[0].dtype).numpy or got.dtype.kind in "UO", (runtime, got.dtype)
        np.testing.assert_array_equal(np.asarray(got, dtype=expected.dtype), expected, err_msg=runtime)
    exported = geir.to_onnx(graph)
    assert exported.graph.output[0].type.tensor_type.elem_type == output


def test_sub_byte_types_run_on_numpy_and_are_refused_clearly_on_onnxruntime():
    """int4 is one element per byte in NumPy (ml_dtypes) and two per byte in ONNX Runtime."""
    model = _model(helper.make_node("Cast", ["a"], ["y"], to=T.INT4), {"a": T.FLOAT}, T.INT4)
    feeds = {"a": np.array([1.0, -3.0, 7.0], np.float32)}
    graph = geir.from_onnx(model)
    got = geir.run(graph, feeds, runtime="numpy")["y"]
    assert got.dtype == ml_dtypes.int4
    np.testing.assert_array_equal(got.astype(np.int8), ReferenceEvaluator(model).run(None, feeds)[0].astype(np.int8))
    with pytest.raises(GraphError, match="its inputs or outputs are int4, which ONNX Runtime packs"):
        geir.run(graph, feeds, runtime="onnxruntime")


def test_string_and_float8_constants_import_and_export():
    strings = helper.make_node("Constant", [], ["s"], value=helper.make_tensor("s", T.STRING, [2], [b"x", b"yz"]))
    concat = helper.make_node("StringConcat", ["s", "a"], ["y"])
    graph = helper.make_graph([strings, concat], "consts", [helper.make_tensor_value_info("a", T.STRING, [2])],
                              [helper.make_tensor_value_info("y", T.STRING, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    imported = geir.from_onnx(model)
    feeds = {"a": np.array(["1", "2"], dtype=object)}
    for runtime in ("numpy", "onnxruntime"):
        assert list(geir.run(imported, feeds, runtime=runtime)["y"]) == ["x1", "yz2"]
    session = ort.InferenceSession(geir.to_onnx(imported).SerializeToString(), providers=["CPUExecutionProvider"])
    assert list(session.run(None, feeds)[0]) == ["x1", "yz2"]
