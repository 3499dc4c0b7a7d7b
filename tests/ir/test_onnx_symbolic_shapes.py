"""Sizes computed inside an exported graph (Shape -> Gather -> Range -> a table sliced to the sequence length) get
the inputs' symbols on import when asked (``symbolic_shapes=True``), through ONNX Runtime's symbolic inference:
ONNX's own names them anew (unk__N), and a fusion rule must then take a rope table's length for another size than the
sequence's. The inference never assumes two symbols equal, writes no file, and a hostile size skips it."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import geir
from geir.tools import onnx_import, onnx_symbolic_shapes

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _rope_with_computed_table(d: int = 8) -> onnx.ModelProto:
    """x (b, s, 2, d) rotated by tables gathered at positions Range(0, Shape(x)[1]) and unsqueezed to (1, s, 1, d), as
    TorchScript exports write them."""
    half = d // 2
    inits = [numpy_helper.from_array(np.cos(np.arange(64 * d).reshape(64, d) / 7).astype(np.float32), "cos_cached"),
             numpy_helper.from_array(np.sin(np.arange(64 * d).reshape(64, d) / 7).astype(np.float32), "sin_cached"),
             numpy_helper.from_array(np.array(1, np.int64), "one"), numpy_helper.from_array(np.array(0, np.int64),
                                                                                           "zero"),
             *(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
               [("i1", 1), ("lo", [0]), ("mid", [half]), ("hi", [d]), ("last", [-1]), ("outer", [0, 2])])]
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "i1"], ["seq"], axis=0),
             helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
             helper.make_node("Gather", ["cos_cached", "positions"], ["cos_rows"], axis=0),
             helper.make_node("Gather", ["sin_cached", "positions"], ["sin_rows"], axis=0),
             helper.make_node("Unsqueeze", ["cos_rows", "outer"], ["cos"]),
             helper.make_node("Unsqueeze", ["sin_rows", "outer"], ["sin"]),
             helper.make_node("Slice", ["x", "lo", "mid", "last"], ["x1"]),
             helper.make_node("Slice", ["x", "mid", "hi", "last"], ["x2"]),
             helper.make_node("Neg", ["x2"], ["minus_x2"]),
             helper.make_node("Concat", ["minus_x2", "x1"], ["rotated"], axis=-1),
             helper.make_node("Mul", ["x", "cos"], ["a"]), helper.make_node("Mul", ["rotated", "sin"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("x", F32, ["b", "s", 2, d])],
                              [helper.make_tensor_value_info("y", F32, ["b", "s", 2, d])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _type_of(graph: geir.Graph, name: str):
    return next(v.type for v in graph.values() if v.name == name)


def test_a_table_sliced_to_the_sequence_gets_the_sequence_symbol_and_its_rope_fuses(tmp_path, monkeypatch):
    pytest.importorskip("sympy", reason="sympy is not installed (a geir dependency: pip install -e .)")
    monkeypatch.chdir(tmp_path)
    graph = geir.from_onnx(_rope_with_computed_table(), symbolic_shapes=True)
    assert _type_of(graph, "cos").shape == (1, "s", 1, 8)
    fused, report = geir.fuse(graph, allow_stricter_data=True)
    assert [f.became.split(" ")[0] for f in report.fused] == ["InplacePartialRotaryMul"], report
    x = np.random.default_rng(0).standard_normal((2, 5, 2, 8)).astype(np.float32)
    for runtime in ("numpy", "onnxruntime"):
        np.testing.assert_array_equal(geir.run(fused, {"x": x}, runtime=runtime)["y"],
                                      geir.run(graph, {"x": x}, runtime=runtime)["y"])
    assert os.listdir(tmp_path) == []                          # the tool's own entry point would write a file here


@pytest.mark.parametrize("asked", [False, True])
def test_without_the_inference_the_table_keeps_a_size_of_its_own(monkeypatch, asked):
    """By default (the tool has given wrong sizes), or where it derives nothing (no sympy, say)."""
    if asked:
        monkeypatch.setattr(onnx_import, "symbolic_value_infos", lambda model: [])
    graph = geir.from_onnx(_rope_with_computed_table(), symbolic_shapes=asked)
    assert _type_of(graph, "cos").shape[1] != "s"
    _, report = geir.fuse(graph, allow_stricter_data=True)
    assert not report.fused and "RP-S8" in report.near_misses[0].reason


def test_two_different_symbols_are_never_merged():
    """x (b, s) + y (b, t): the result's second dim is s or t or either's 1, known only when the graph runs."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Add", ["x", "y"], ["sum"]),
         helper.make_node("Identity", ["sum"], ["z"])], "merge",
        [helper.make_tensor_value_info("x", F32, ["b", "s"]), helper.make_tensor_value_info("y", F32, ["b", "t"])],
        [helper.make_tensor_value_info("z", F32, ["b", None]), helper.make_tensor_value_info("shape", I64, [2])]),
        opset_imports=[helper.make_opsetid("", 17)])
    graph = geir.from_onnx(model, symbolic_shapes=True)
    assert _type_of(graph, "z").shape[1] not in ("s", "t")
    assert geir.run(graph, {"x": np.ones((1, 3), np.float32), "y": np.ones((1, 1), np.float32)})["z"].shape == (1, 3)


def test_a_huge_computed_integer_tensor_skips_the_inference(monkeypatch):
    called = []
    monkeypatch.setattr(onnx_import, "symbolic_value_infos", lambda model: called.append(model) or [])
    big = onnx_symbolic_shapes.SYMBOLIC_INTEGER_ELEMENTS + 1
    model = helper.make_model(helper.make_graph(
        [helper.make_node("ConstantOfShape", ["n"], ["zeros"], value=helper.make_tensor("v", I64, [1], [0])),
         helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Concat", ["shape", "shape"], ["both"], axis=0),
         helper.make_node("Reshape", ["x", "both"], ["y"])], "huge",
        [helper.make_tensor_value_info("x", F32, ["b"])],
        [helper.make_tensor_value_info("zeros", I64, [big]), helper.make_tensor_value_info("y", F32, [None])],
        initializer=[numpy_helper.from_array(np.array([big], np.int64), "n")]),
        opset_imports=[helper.make_opsetid("", 17)])
    geir.from_onnx(model, symbolic_shapes=True)
    assert called == []


@pytest.mark.parametrize("flag, fused", [([], 0), (["--symbolic-shapes"], 1)])
def test_geir_fuse_takes_the_inference_from_the_command_line(tmp_path, monkeypatch, capsys, flag, fused):
    pytest.importorskip("sympy", reason="sympy is not installed (a geir dependency: pip install -e .)")
    from geir.tools.cli import main

    monkeypatch.chdir(tmp_path)
    onnx.save(_rope_with_computed_table(), "rope.onnx")
    assert main(["fuse", "rope.onnx", "fused.onnx", "--allow-stricter-data", *flag]) == 0
    assert f"{fused} fused" in capsys.readouterr().out
    ops = [n.op_type for n in onnx.load("fused.onnx").graph.node]
    assert ops.count("InplacePartialRotaryMul") == fused
    assert sorted(os.listdir(tmp_path)) == ["fused.onnx", "rope.onnx"]
