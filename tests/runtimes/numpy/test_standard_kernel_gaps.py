"""Where onnx.reference's kernel is not ONNX's definition, the NumPy runtime runs its own (GatherElements) or
corrects the result (Dropout's mask before opset 10); ONNX Runtime is the independent oracle."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import geir

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _gather_model(data_shape, index_shape, axis) -> onnx.ModelProto:
    node = helper.make_node("GatherElements", ["data", "index"], ["y"], axis=axis)
    graph = helper.make_graph([node], "gather", [helper.make_tensor_value_info("data", F32, list(data_shape)),
                                                 helper.make_tensor_value_info("index", I64, list(index_shape))],
                              [helper.make_tensor_value_info("y", F32, list(index_shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_gather_elements_matches_onnxruntime_with_smaller_and_negative_indices(data):
    rank = data.draw(st.integers(1, 3))
    data_shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    axis = data.draw(st.integers(-rank, rank - 1))
    index_shape = tuple(data.draw(st.integers(1 if k == axis % rank else 1, 5 if k == axis % rank else n))
                        for k, n in enumerate(data_shape))
    size = data_shape[axis % rank]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    feeds = {"data": rng.standard_normal(data_shape).astype(np.float32),
             "index": rng.integers(-size, size, index_shape)}
    model = _gather_model(data_shape, index_shape, axis)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(geir.run(model, feeds, runtime="numpy")["y"], want)


def test_gather_elements_out_of_range_index_is_an_execution_error_not_a_wrapped_value():
    model = _gather_model((2, 3), (2, 3), 1)
    feeds = {"data": np.zeros((2, 3), np.float32), "index": np.array([[0, 1, 2], [3, 0, 0]])}
    with pytest.raises(geir.ExecutionError, match=r"input 'indices': expected values in \[-3, 2\] .* got 3"):
        geir.run(model, feeds, runtime="numpy")


def test_dropout_before_opset_10_gives_its_mask_in_the_datas_type():
    node = helper.make_node("Dropout", ["x"], ["y", "mask"], ratio=0.5)
    graph = helper.make_graph([node], "dropout", [helper.make_tensor_value_info("x", F32, [2, 3])],
                              [helper.make_tensor_value_info("y", F32, [2, 3]),
                               helper.make_tensor_value_info("mask", F32, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 7)])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    outs = geir.run(model, {"x": x}, runtime="numpy")
    np.testing.assert_array_equal(outs["y"], x)       # inference: the identity
    assert outs["mask"].dtype == np.float32 and (outs["mask"] == 1).all()
