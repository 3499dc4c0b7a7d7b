"""geir.backend is an ONNX backend: prepare/run a model on each runtime, devices named clearly."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import geir
import geir.backend as backend


def _model():
    graph = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"])], "add",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                              [helper.make_tensor("b", TensorProto.FLOAT, [2], [10, 20])])
    graph.input.pop()   # b is an initializer only
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("device, options", [("CPU", {}), ("numpy", {}), ("onnxruntime", {}),
                                             ("CPU", {"runtime": "onnxruntime"})])
def test_prepare_and_run_on_each_runtime(device, options):
    rep = backend.prepare(_model(), device, **options)
    assert rep.runtime == options.get("runtime", device if device != "CPU" else "numpy")
    (y,) = rep.run([np.array([1, 2], np.float32)])
    np.testing.assert_array_equal(y, [11, 22])
    assert rep.run({"x": np.array([0, 0], np.float32)}).y.tolist() == [10, 20]
    assert backend.run_model(_model(), [np.ones(2, np.float32)], device, **options)[0].tolist() == [11, 21]


def test_devices_and_runtimes_are_named_clearly():
    assert backend.supports_device("CPU") and backend.supports_device("onnxruntime")
    assert not backend.supports_device("CUDA") and not backend.supports_device("no such thing")
    with pytest.raises(geir.GraphError, match="device 'CUDA': expected CPU or a runtime"):
        backend.prepare(_model(), "CUDA")
    with pytest.raises(geir.GraphError, match="device 'no such thing': expected CPU or a runtime"):
        backend.prepare(_model(), "no such thing")
    with pytest.raises(geir.GraphError, match="runtime 'tpu': expected one of"):
        backend.backend_for("tpu")
    with pytest.raises(geir.GraphError, match="runtime 'tpu': expected one of"):
        backend.prepare(_model(), runtime="tpu")
    with pytest.raises(geir.GraphError, match="2 inputs given, the model 'add' takes 1 \\(x\\)"):
        backend.prepare(_model()).run([np.ones(2, np.float32)] * 2)
    assert backend.backend_for("onnxruntime").prepare(_model()).runtime == "onnxruntime"
