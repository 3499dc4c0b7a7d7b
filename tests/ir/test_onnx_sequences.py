"""Sequence and optional values of standard ops (issue 25, item 3): typed by kind (``TensorType.kind``), fed and
returned as lists of arrays or None, on both runtimes and through the export; they have no shape to ask."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import geir
from geir import GraphError
from geir.ir._types import TensorType, UnknownRankError

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs) -> onnx.ModelProto:
    return helper.make_model(helper.make_graph(nodes, "seq", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 18)])


def _seq_info(name: str, elem: int = F32) -> onnx.ValueInfoProto:
    return helper.make_value_info(name, helper.make_sequence_type_proto(helper.make_tensor_type_proto(elem, None)))


def _same(got, want) -> None:
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    else:
        np.testing.assert_array_equal(got, want)


def test_a_sequence_input_and_output_on_both_runtimes_and_the_export():
    nodes = [helper.make_node("SequenceInsert", ["items", "extra"], ["longer"]),
             helper.make_node("SequenceLength", ["longer"], ["count"]),
             helper.make_node("ConcatFromSequence", ["longer"], ["joined"], axis=0)]
    model = _model(nodes, [_seq_info("items"), helper.make_tensor_value_info("extra", F32, [2])],
                   [_seq_info("longer"), helper.make_tensor_value_info("count", I64, []),
                    helper.make_tensor_value_info("joined", F32, [None])])
    graph = geir.from_onnx(model)
    assert graph.inputs[0].type == TensorType("float32", None, "sequence") and str(graph.inputs[0].type) == \
        "seq(float32)"
    with pytest.raises(geir.ExecutionError, match=r"output buffer 'longer': the output is a seq\(float32\), not a "
                                                  r"tensor: it takes no buffer"):
        geir.run(graph, {"items": [np.ones(3, np.float32)], "extra": np.ones(2, np.float32)}, runtime="numpy",
                 outputs={"longer": np.ones(3, np.float32)})
    feeds = {"items": [np.ones(3, np.float32), np.arange(1, dtype=np.float32)], "extra": np.full(2, 7, np.float32)}
    want = dict(zip(("longer", "count", "joined"), ReferenceEvaluator(model).run(None, feeds)))
    for runtime in ("numpy", "onnxruntime"):
        outs = geir.run(graph, feeds, runtime=runtime)
        for name in want:
            _same(outs[name], want[name])
    session = ort.InferenceSession(geir.to_onnx(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    _same(session.run(None, feeds)[0], want["longer"])
    with pytest.raises(geir.ExecutionError, match=r"input 'items': expected a list of arrays \(seq\(float32\)\), got "
                                                  r"ndarray"):
        geir.run(graph, {**feeds, "items": np.ones(3, np.float32)}, runtime="numpy")
    with pytest.raises(geir.ExecutionError, match=r"input 'items': item 1: expected dtype float32, got int64"):
        geir.run(graph, {**feeds, "items": [np.ones(3, np.float32), np.ones(2, np.int64)]}, runtime="onnxruntime")


def test_a_sequence_made_and_taken_apart_inside_the_graph():
    nodes = [helper.make_node("SplitToSequence", ["x"], ["parts"], axis=1, keepdims=0),
             helper.make_node("SequenceAt", ["parts", "at"], ["column"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, [2, 3]), helper.make_tensor_value_info("at", I64, [])],
                   [helper.make_tensor_value_info("column", F32, [2])])
    graph = geir.from_onnx(model)
    inner = next(n for n in graph.nodes if n.op_type == "SplitToSequence").outputs[0]
    assert inner.type.kind == "sequence" and not inner.type.has_rank
    with pytest.raises(UnknownRankError, match="has no shape"):
        inner.type.shape
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for runtime in ("numpy", "onnxruntime"):
        np.testing.assert_array_equal(geir.run(graph, {"x": x, "at": np.array(-1)}, runtime=runtime)["column"], x[:, 2])


def test_an_optional_input_may_be_fed_none():
    nodes = [helper.make_node("OptionalHasElement", ["maybe"], ["present"])]
    optional = helper.make_value_info("maybe", helper.make_optional_type_proto(helper.make_tensor_type_proto(F32, [2])))
    model = _model(nodes, [optional], [helper.make_tensor_value_info("present", TensorProto.BOOL, [])])
    graph = geir.from_onnx(model)
    assert graph.inputs[0].type.kind == "optional" and str(graph.inputs[0].type) == "optional(float32)"
    assert not graph.inputs[0].type.has_rank and not graph.inputs[0].type.is_static
    for runtime in ("numpy", "onnxruntime"):
        assert geir.run(graph, {"maybe": None}, runtime=runtime)["present"] == np.array(False)
        assert geir.run(graph, {"maybe": np.ones(2, np.float32)}, runtime=runtime)["present"] == np.array(True)
        assert geir.run(graph, {}, runtime=runtime)["present"] == np.array(False)     # an optional may go unfed


def test_our_ops_refuse_a_sequence():
    b = geir.GraphBuilder("seq")
    items = b.input("items", "float16", None, kind="sequence")
    cos = b.input("cos", "float16", (1, 4, 1, 8))
    with pytest.raises(GraphError, match=r"input 'x': expected a known rank .* got seq\(float16\)"):
        b.InplacePartialRotaryMul(items, cos, cos, rotary_mode=1, partial_slice=[0, 8])


def test_sequence_map_without_additional_inputs():
    """SequenceMap's optional variadic inputs left out: ONNX's inference must not see a trailing absent one."""
    body = helper.make_graph([helper.make_node("Shape", ["item"], ["shape"])], "body",
                             [helper.make_tensor_value_info("item", F32, ["n"])],
                             [helper.make_tensor_value_info("shape", I64, [1])])
    model = _model([helper.make_node("SequenceMap", ["items"], ["shapes"], body=body)], [_seq_info("items")],
                   [_seq_info("shapes", I64)])
    graph = geir.from_onnx(model)
    feeds = {"items": [np.ones(3, np.float32), np.ones(5, np.float32)]}
    for runtime in ("numpy", "onnxruntime"):
        _same(geir.run(graph, feeds, runtime=runtime)["shapes"], [np.array([3]), np.array([5])])
