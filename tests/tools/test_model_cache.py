"""geir.run of a path or ModelProto imports and compiles once per content, and never runs stale content."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import geir
from geir.tools import model_cache


def _scale_model(factor: float, name: str = "scale") -> onnx.ModelProto:
    """y = x * factor, as a plain ONNX model."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])], name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("k", TensorProto.FLOAT, [], [factor])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture(autouse=True)
def _empty_cache():
    model_cache.clear()
    yield
    model_cache.clear()


@pytest.fixture
def imports(monkeypatch):
    """The models really imported, in order."""
    seen: list[str] = []
    real = model_cache.from_onnx

    def counting(model):
        seen.append(model.graph.name)
        return real(model)
    monkeypatch.setattr(model_cache, "from_onnx", counting)
    return seen


X = {"x": np.array([1.0, 2.0], np.float32)}


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_a_path_is_imported_and_compiled_once(tmp_path, imports, runtime):
    path = tmp_path / "scale.onnx"
    onnx.save(_scale_model(3.0), path)
    first = geir.run(path, X, runtime=runtime)
    graph = model_cache.imported(path)
    executables = [v for (owner, _), v in graph.compiled.items() if owner == runtime]
    second = geir.run(str(path), X, runtime=runtime)
    np.testing.assert_array_equal(first["y"], [3.0, 6.0])
    np.testing.assert_array_equal(second["y"], first["y"])
    assert imports == ["scale"]
    assert len(executables) == 1                                 # the second run compiled nothing new
    assert [v for (owner, _), v in graph.compiled.items() if owner == runtime] == executables


def test_an_edited_file_or_proto_is_new_content_never_a_stale_result(tmp_path, imports):
    path = tmp_path / "scale.onnx"
    onnx.save(_scale_model(3.0), path)
    assert geir.run(path, X)["y"].tolist() == [3.0, 6.0]
    onnx.save(_scale_model(5.0), path)                        # same path, same size, other content
    assert geir.run(path, X)["y"].tolist() == [5.0, 10.0]
    proto = _scale_model(2.0)
    assert geir.run(proto, X)["y"].tolist() == [2.0, 4.0]
    proto.graph.initializer[0].CopyFrom(helper.make_tensor("k", TensorProto.FLOAT, [], [7.0]))   # edited in place
    assert geir.run(proto, X)["y"].tolist() == [7.0, 14.0]
    assert imports == ["scale"] * 4


def test_the_same_content_by_path_or_proto_is_one_entry(tmp_path, imports):
    proto = _scale_model(3.0)
    path = tmp_path / "scale.onnx"
    onnx.save(proto, path)
    geir.run(proto, X)
    geir.run(path, X)
    geir.check(path, target="ascend950")
    assert imports == ["scale"]


def test_the_cache_is_bounded_least_recently_used_first_and_cleared(imports):
    protos = [_scale_model(float(i), f"m{i}") for i in range(model_cache.MAX_MODELS + 1)]
    for proto in protos:
        geir.run(proto, X)
    geir.run(protos[0], X)                                    # the oldest was dropped: imported again
    assert imports == [f"m{i}" for i in range(model_cache.MAX_MODELS + 1)] + ["m0"]
    geir.run(protos[-1], X)                                   # still held
    assert len(imports) == model_cache.MAX_MODELS + 2
    model_cache.clear()
    geir.run(protos[-1], X)
    assert imports[-1] == f"m{model_cache.MAX_MODELS}" and len(imports) == model_cache.MAX_MODELS + 3


def test_a_bad_file_still_fails_with_its_name(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"not a model")
    with pytest.raises(geir.GraphError, match="broken.onnx' is not an ONNX model"):
        geir.run(path, X)
