"""Initializers in external data files beside the model (as PyTorch's dynamo exporter writes them) load through
``geir.load_onnx`` and ``geir.run(path)``; a location that leaves the model's folder, a missing file or bytes
that do not match the tensor are GraphErrors naming the initializer."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import geir
from geir import GraphError


def _save(tmp_path, location="weights.bin") -> tuple[str, np.ndarray]:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "ext",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              initializer=[numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    path = str(tmp_path / "model.onnx")
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=0)
    return path, w


def test_external_weights_load_and_run(tmp_path):
    path, w = _save(tmp_path)
    assert onnx.load(path, load_external_data=False).graph.initializer[0].data_location == TensorProto.EXTERNAL
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(geir.load_onnx(path).constants["w"], w)
    for runtime in ("numpy", "onnxruntime"):
        np.testing.assert_array_equal(geir.run(path, {"x": x}, runtime=runtime)["y"], x @ w)
    with pytest.raises(GraphError, match=r"initializer 'w' is stored outside the model; load the model with "
                                         r"geir.load_onnx\(path\)"):
        geir.from_onnx(onnx.load(path, load_external_data=False))


def _rewrite(path: str, **entries: str) -> None:
    model = onnx.load(path, load_external_data=False)
    tensor = model.graph.initializer[0]
    known = {e.key: e.value for e in tensor.external_data} | entries
    del tensor.external_data[:]
    for key, value in known.items():
        tensor.external_data.add(key=key, value=value)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


@pytest.mark.parametrize("entries, message", [
    ({"location": "../outside.bin"}, r"expected a file name relative to the model's folder"),
    ({"location": "/etc/passwd"}, r"expected a file name relative to the model's folder"),
    ({"location": "nowhere.bin"}, r"external data file 'nowhere.bin' is missing"),
    ({"length": "8"}, r"expected 48 bytes"),
    ({"offset": "40"}, r"bytes \[40, 88\) of 'weights.bin' \(48 bytes\)"),
    ({"offset": "many"}, r"expected integers"),
])
def test_hostile_external_data_is_refused_naming_the_initializer(tmp_path, entries, message):
    path, _ = _save(tmp_path)
    _rewrite(path, **entries)
    with pytest.raises(GraphError, match=rf"initializer 'w': .*{message}"):
        geir.load_onnx(path)


def test_a_link_out_of_the_models_folder_is_refused(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    path, _ = _save(inner)
    os.replace(inner / "weights.bin", tmp_path / "weights.bin")
    os.symlink(tmp_path / "weights.bin", inner / "weights.bin")
    with pytest.raises(GraphError, match="leads out of the model's folder"):
        geir.load_onnx(path)
