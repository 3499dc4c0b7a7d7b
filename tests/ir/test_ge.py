"""``geir.ge``: CANN's GE IR call path, its conversions and every error it reports."""

from __future__ import annotations

import re

import numpy as np
import pytest

import geir
from geir import ge
from geir.tools.ge_examples import EXAMPLES
from oracles.moe import unpermute_grad_reference
from oracles.numerics import assert_matches_reference
from oracles.rotary import rotary_reference
from oracles.sfa import forward_reference
from rotary.helpers import empty_grad_slices_expected


@pytest.fixture(autouse=True)
def _ge_lifetime():
    assert ge.GEInitialize({"ge.exec.deviceId": "0", "ge.graphRunMode": "1"}) == ge.SUCCESS
    ge.GEGetErrorMsgV2(), ge.GEGetWarningMsgV2()     # start from empty channels
    yield
    ge.GEFinalize()


def _desc(shape, dtype=ge.DT_FLOAT16):
    return ge.TensorDesc(ge.Shape(shape), ge.FORMAT_ND, dtype)


def _rope_graph(dy_desc=None, table_desc=None, indices=(0, 1, 2), slice_=(0, 64), descs=True):
    dy_desc = dy_desc or _desc([2, 128, 8, 64])
    table_desc = table_desc or _desc([1, 128, 1, 64])
    graph = ge.Graph("tc_ge_irrun_test")
    data = []
    for name, index, desc in zip(("dy", "cos", "sin"), indices, (dy_desc, table_desc, table_desc)):
        op = ge.op.Data(name).set_attr_index(index)
        if descs:
            op.update_input_desc_x(desc)
            op.update_output_desc_y(desc)
        graph.AddOp(op)
        data.append(op)
    dy, cos, sin = data
    node = (ge.op.InplacePartialRotaryMulGrad("rope_grad").set_input_dy(dy).set_input_cos(cos).set_input_sin(sin)
            .set_attr_rotary_mode(1).set_attr_partial_slice(list(slice_)))
    graph.SetInputs(data).SetOutputs([node])
    return graph, node, (dy_desc, table_desc)


def _rope_tensors(dy_desc, table_desc, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(d.GetShape().GetDims()).astype(np.float16) for d in (dy_desc, table_desc, table_desc)]
    return arrays, [ge.Tensor(d, a) for d, a in zip((dy_desc, table_desc, table_desc), arrays)]


@pytest.mark.parametrize("runtime", geir.runtimes.runtime_names())
def test_the_issue_example_runs_and_matches_geir_run(runtime, tmp_path):
    graph, _, (dy_desc, table_desc) = _rope_graph()
    session = ge.Session({"geir.runtime": runtime})
    assert session.AddGraph(0, graph) == ge.SUCCESS, ge.GEGetErrorMsgV2()
    arrays, tensors = _rope_tensors(dy_desc, table_desc)
    before = [a.copy() for a in arrays]
    outputs: list = []
    assert session.RunGraph(0, tensors, outputs) == ge.SUCCESS, ge.GEGetErrorMsgV2()
    assert outputs[0].GetTensorDesc().GetShape().GetDims() == [2, 128, 8, 64]
    assert outputs[0].GetTensorDesc().GetDataType() == ge.DT_FLOAT16
    want = geir.run(graph.to_geir(), dict(zip(("dy", "cos", "sin"), arrays)))["rope_grad.dy"]
    np.testing.assert_array_equal(outputs[0].GetData(), want)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))      # feeds untouched
    assert ge.aclgrphDumpGraph(graph, str(tmp_path / "dump_rope_grad")) == ge.SUCCESS
    assert "ai.cann::InplacePartialRotaryMulGrad(dy, cos, sin)" in (tmp_path / "dump_rope_grad.txt").read_text()
    assert geir.load_onnx(str(tmp_path / "dump_rope_grad.onnx")).nodes[0].op_type == "InplacePartialRotaryMulGrad"
    assert ge.GEGetErrorMsgV2() == ""


def test_every_op_of_the_registry_is_generated_with_its_accessors():
    for schema in geir.schemas.all_schemas():
        cls = getattr(ge.op, schema.op_type)
        for spec in schema.inputs:
            assert callable(getattr(cls, f"set_input_{spec.name}")) and callable(getattr(cls, f"update_input_desc_{spec.name}"))
        for spec in schema.outputs:
            assert callable(getattr(cls, f"update_output_desc_{spec.name}"))
        for attr in schema.attributes:
            op = cls("probe")
            if not attr.required:
                assert getattr(op, f"get_attr_{attr.name}")() == attr.default
    op = ge.op.SparseFlashAttention("sfa").set_attr_scale_value(0.5)
    assert op.get_attr_scale_value() == 0.5 and op.get_attr_sparse_mode() == 3
    with pytest.raises(AttributeError, match="ge.op has no operator 'NoSuchOp'"):
        ge.op.NoSuchOp


def test_conversion_both_ways_keeps_the_graph():
    graph, _, _ = _rope_graph()
    built = graph.to_geir()
    again = ge.Graph.from_geir(built).to_geir()
    assert str(again).splitlines()[:3] == str(built).splitlines()[:3]
    assert [v.name for v in again.inputs] == ["dy", "cos", "sin"]


def test_a_multi_output_op_selects_outputs_by_name_and_index():
    case = EXAMPLES["sparse_flash_attention"]()
    assert case.status == ge.SUCCESS and len(case.outputs) == 3
    tokens = ge.op.Data("t").set_attr_index(0).update_output_desc_y(_desc([4, 8], ge.DT_FLOAT))
    idx = ge.op.Data("i").set_attr_index(1).update_output_desc_y(_desc([4], ge.DT_INT32))
    dy = ge.op.Data("dy").set_attr_index(2).update_output_desc_y(_desc([4, 8], ge.DT_FLOAT))
    grad = (ge.op.MoeTokenUnpermuteGrad("g").set_input_permuted_tokens(tokens).set_input_unpermuted_tokens_grad(dy)
            .set_input_sorted_indices(idx))
    consumer = ge.op.MoeTokenUnpermute("fwd").set_input_permuted_tokens(grad, "permuted_tokens_grad") \
        .set_input_sorted_indices(idx)
    graph = ge.Graph("two").SetInputs([tokens, idx, dy]).SetOutputs([(grad, [0]), consumer])
    built = graph.to_geir()
    assert [v.name for v in built.outputs] == ["g.permuted_tokens_grad", "fwd.unpermuted_tokens"]
    with pytest.raises(geir.GraphError, match=r"MoeTokenUnpermute 'bad': input 'permuted_tokens': output name: expected "
                                              r"one of permuted_tokens_grad, probs_grad of MoeTokenUnpermuteGrad, got 'y'"):
        ge.op.MoeTokenUnpermute("bad").set_input_permuted_tokens(grad, "y")
    with pytest.raises(geir.GraphError, match=r"output of MoeTokenUnpermuteGrad 'g': expected a name \(permuted_tokens_grad, "
                                              r"probs_grad\) or an index < 2, got 2"):
        ge.op.MoeTokenUnpermute("bad").set_input_permuted_tokens(grad, 2)


@pytest.mark.parametrize("mutate, message", [
    (lambda g, n: g._inputs[0].input_descs.clear() or g._inputs[0].output_descs.clear(),
     r"Data 'dy': no tensor desc: call update_output_desc_y"),
    (lambda g, n: g._inputs[2].set_attr_index(1), r"Data 'sin': attribute 'index': expected each of 0..2 once, got 1 "
                                                  r"again \(also Data 'cos'\)"),
    (lambda g, n: g._inputs[2].set_attr_index(5), r"Data 'sin': attribute 'index': expected 0..2 .* got 5: indices "
                                                  r"skip a position"),
    (lambda g, n: n.update_output_desc_dy(_desc([2, 128, 8, 64], ge.DT_FLOAT)),
     r"InplacePartialRotaryMulGrad 'rope_grad': output desc 'dy': expected float16\[2,128,8,64\] \(what the graph "
     r"infers\), got DT_FLOAT\[2, 128, 8, 64\]"),
    (lambda g, n: n.update_input_desc_cos(_desc([1, 128, 1, 32])),
     r"InplacePartialRotaryMulGrad 'rope_grad': input desc 'cos': expected float16\[1,128,1,64\] \(what the graph gives "
     r"it\), got DT_FLOAT16\[1, 128, 1, 32\]"),
    (lambda g, n: g.SetInputs(g._inputs[:2]), r"Data 'sin' feeds the outputs but is not in SetInputs"),
    (lambda g, n: n.set_attr_partial_slice([0, 96]), r"\[RP-S5\] .*rope_grad"),
])
def test_graph_errors_name_the_op_and_the_input(mutate, message):
    graph, node, _ = _rope_graph()
    mutate(graph, node)
    with pytest.raises(geir.GraphError, match=message):
        graph.to_geir()
    session = ge.Session({})
    assert session.AddGraph(0, graph) == ge.FAILED
    assert re.search(message, ge.GEGetErrorMsgV2())


def test_attributes_are_checked_when_set():
    op = ge.op.InplacePartialRotaryMulGrad("r")
    with pytest.raises(geir.GraphError, match=r"\[SCH-3\] InplacePartialRotaryMulGrad 'r': attribute 'rotary_mode': "
                                              r"expected kind Int, got 'one' \(str\)"):
        op.set_attr_rotary_mode("one")
    with pytest.raises(geir.GraphError, match=r"\[SCH-3\] .*attribute 'mode': expected one of rotary_mode, partial_slice"):
        op.SetAttr("mode", 1)
    with pytest.raises(geir.GraphError, match=r"input name: expected one of dy, cos, sin of InplacePartialRotaryMulGrad"):
        op.SetInput("x", ge.op.Data("d"))


def test_run_graph_checks_tensors_against_the_data_descs():
    graph, _, (dy_desc, table_desc) = _rope_graph()
    session = ge.Session({})
    assert session.AddGraph(7, graph) == ge.SUCCESS
    arrays, tensors = _rope_tensors(dy_desc, table_desc)
    out: list = []
    assert session.RunGraph(7, tensors[:2], out) == ge.FAILED
    assert "expected 3 tensors (Data 0: 'dy', 1: 'cos', 2: 'sin'), got 2" in ge.GEGetErrorMsgV2()
    wrong = ge.Tensor(_desc([1, 128, 1, 64], ge.DT_FLOAT), arrays[1].astype(np.float32))
    assert session.RunGraph(7, [tensors[0], wrong, tensors[2]], out) == ge.FAILED
    assert "input 1 (Data 'cos'): data type: expected float16 (the Data desc), got DT_FLOAT" in ge.GEGetErrorMsgV2()
    short = ge.Tensor(_desc([1, 64, 1, 64]), arrays[1][:, :64])
    assert session.RunGraph(7, [tensors[0], tensors[1], short], out) == ge.FAILED
    assert "input 2 (Data 'sin'): shape: expected [1, 128, 1, 64] (the Data desc), got [1, 64, 1, 64]" in \
        ge.GEGetErrorMsgV2()
    assert session.RunGraph(8, tensors, out) == ge.FAILED and "graph id 8 has not been added" in ge.GEGetErrorMsgV2()
    assert session.AddGraph(7, graph) == ge.FAILED and "graph id 7 is already added" in ge.GEGetErrorMsgV2()
    with pytest.raises(geir.GraphError, match=r"ge.Tensor: data: expected float16 \(DT_FLOAT16 in the desc\), got float32"):
        ge.Tensor(dy_desc, np.zeros((2, 128, 8, 64), np.float32))
    assert session.RemoveGraph(7) == ge.SUCCESS and session.RemoveGraph(7) == ge.FAILED


def test_raise_errors_option_raises_the_geir_error_and_unknown_options_are_refused():
    graph, _, (dy_desc, table_desc) = _rope_graph()
    session = ge.Session({"geir.raise_errors": "1"})
    session.AddGraph(0, graph)
    with pytest.raises(geir.ExecutionError, match="expected 3 tensors"):
        session.RunGraph(0, [], [])
    with pytest.raises(geir.GraphError, match=r"option 'geir.runtme': expected one of geir's \(geir.runtime"):
        ge.Session({"geir.runtme": "numpy"})
    with pytest.raises(geir.GraphError, match=r"option 'geir.runtime': expected one of numpy, onnxruntime, got 'tvm'"):
        ge.Session({"geir.runtime": "tvm"})
    with pytest.raises(geir.GraphError, match=r"option 'geir.target': expected one of ascend910b"):
        ge.Session({"geir.target": "ascend310"})
    with pytest.raises(geir.GraphError, match=r"option 1: expected a string key and a string value"):
        ge.Session({1: "x"})
    assert ge.GEInitialize({"ge.graphRunMode": "2"}) == ge.FAILED
    assert "option 'ge.graphRunMode': expected '0' (online inference) or '1' (training), got '2'" in ge.GEGetErrorMsgV2()


def test_a_target_refuses_what_the_device_refuses_naming_the_rule():
    graph, _, _ = _rope_graph(dy_desc=_desc([2, 128, 8, 64], ge.DT_FLOAT), table_desc=_desc([1, 128, 1, 64], ge.DT_FLOAT))
    report = geir.check(graph.to_geir(), "ascend910b")
    assert not report.ok                                  # the case breaks a 910B restriction
    assert ge.Session({}).AddGraph(0, graph) == ge.SUCCESS                    # no target: nothing to refuse
    assert ge.Session({"geir.target": "ascend910b"}).AddGraph(1, graph) == ge.FAILED
    message = ge.GEGetErrorMsgV2()
    assert sorted(report.rules())[0] in message and "ascend910b" in message


def test_add_graph_before_initialize_fails():
    ge.GEFinalize()
    graph, _, _ = _rope_graph()
    assert ge.Session({}).AddGraph(0, graph) == ge.FAILED
    assert "GEInitialize has not been called" in ge.GEGetErrorMsgV2()


def test_a_failed_run_graph_leaves_no_earlier_outputs():
    graph, _, (dy_desc, table_desc) = _rope_graph()
    session = ge.Session({})
    assert session.AddGraph(0, graph) == ge.SUCCESS, ge.GEGetErrorMsgV2()
    _, tensors = _rope_tensors(dy_desc, table_desc)
    outputs: list = []
    assert session.RunGraph(0, tensors, outputs) == ge.SUCCESS and len(outputs) == 1
    assert session.RunGraph(0, tensors[:2], outputs) == ge.FAILED                  # a bad feed
    assert outputs == [] and "expected 3 tensors" in ge.GEGetErrorMsgV2()
    assert session.RunGraph(0, tensors, outputs) == ge.SUCCESS and len(outputs) == 1
    assert session.RunGraph(5, tensors, outputs) == ge.FAILED and outputs == []    # a graph id never added
    raising = ge.Session({"geir.raise_errors": "1"})
    raising.AddGraph(0, graph)
    outputs = ["stale"]
    with pytest.raises(geir.ExecutionError, match="expected 3 tensors"):
        raising.RunGraph(0, [], outputs)
    assert outputs == []


def test_every_session_call_fails_after_ge_finalize():
    graph, _, (dy_desc, table_desc) = _rope_graph()
    session = ge.Session({})
    assert session.AddGraph(0, graph) == ge.SUCCESS, ge.GEGetErrorMsgV2()
    _, tensors = _rope_tensors(dy_desc, table_desc)
    outputs: list = []
    assert session.RunGraph(0, tensors, outputs) == ge.SUCCESS
    assert ge.GEFinalize() == ge.SUCCESS
    assert session.RunGraph(0, tensors, outputs) == ge.FAILED and outputs == []
    assert ge.GEGetErrorMsgV2() == "Session.RunGraph: GEInitialize has not been called (or GEFinalize was)"
    assert session.RemoveGraph(0) == ge.FAILED
    assert ge.GEGetErrorMsgV2() == "Session.RemoveGraph: GEInitialize has not been called (or GEFinalize was)"
    assert session.AddGraph(1, graph) == ge.FAILED
    assert ge.GEGetErrorMsgV2() == "Session.AddGraph: GEInitialize has not been called (or GEFinalize was)"
    assert ge.GEInitialize({}) == ge.SUCCESS              # GE dropped the old session: it stays closed
    for call, action in (("RunGraph", lambda: session.RunGraph(0, tensors, outputs)),
                         ("RemoveGraph", lambda: session.RemoveGraph(0)), ("AddGraph", lambda: session.AddGraph(0, graph))):
        assert action() == ge.FAILED
        assert ge.GEGetErrorMsgV2() == f"Session.{call}: this session was closed by GEFinalize; create a new Session"
    fresh = ge.Session({})
    assert fresh.AddGraph(0, graph) == ge.SUCCESS and fresh.RunGraph(0, tensors, outputs) == ge.SUCCESS
    assert len(outputs) == 1 and fresh.RemoveGraph(0) == ge.SUCCESS


@empty_grad_slices_expected
def test_contract_warnings_go_to_the_warning_channel():
    graph, _, _ = _rope_graph(slice_=(0, 0))
    graph._inputs[1].output_descs[0] = graph._inputs[1].input_descs[0] = _desc([1, 128, 1, 64])
    assert ge.Session({}).AddGraph(0, graph) == ge.SUCCESS, ge.GEGetErrorMsgV2()
    assert "[RP-W1]" in ge.GEGetWarningMsgV2() and ge.GEGetWarningMsgV2() == ""


@pytest.mark.filterwarnings(r"ignore:\[MG-W2\]:geir.GeirWarning")   # CANN's MoE grad example: bf16 tokens, f32 probs
@pytest.mark.parametrize("runtime", geir.runtimes.runtime_names())
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_ported_examples_match_the_float64_references(name, runtime):
    run = EXAMPLES[name](runtime=runtime, seed=3)
    assert run.status == ge.SUCCESS, run.messages
    if name == "moe_token_unpermute_grad":      # the pair that is NaN on the device: reported with the workaround
        assert any("[MG-W2]" in m and "cast probs to bfloat16" in m for m in run.messages), run.messages
    golden = geir.testing.reference(run.graph.to_geir(), run.inputs)          # CANN's standard against the golden
    for got, (output, want) in zip(run.outputs, golden.items()):
        geir.testing.assert_close(got, want, standard="precision_standard", compute_count=256, name=output)
    f = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in run.inputs.items()}
    if name.startswith("inplace_partial_rotary_mul"):
        grad = name.endswith("grad")
        x = f["dy" if grad else "x"]
        want, magnitude = rotary_reference(x, f["cos"], f["sin"], 1, 0, 128, grad)
        assert_matches_reference(run.outputs[0], want, magnitude, name)
    elif name == "moe_token_unpermute_grad":
        ptg, _, pg, _ = unpermute_grad_reference(f["permuted_tokens"], f["unpermuted_tokens_grad"], f["sorted_indices"],
                                           f["probs"])
        np.testing.assert_allclose(run.outputs[0].astype(np.float64), ptg, rtol=2 ** -7, atol=1e-6)
        np.testing.assert_allclose(run.outputs[1], pg, rtol=1e-5, atol=1e-5)
    else:
        out, mx, sm = forward_reference(f["query"], f["key"], f["value"], f["sparse_indices"], scale=float(np.float32(
            1 / np.sqrt(80))), bs=4, mode=3, query_rope=f["query_rope"], key_rope=f["key_rope"])
        np.testing.assert_allclose(run.outputs[0].astype(np.float64), out, rtol=2e-2, atol=2e-3)
        np.testing.assert_allclose(run.outputs[1], mx, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(run.outputs[2], sm, rtol=1e-3, atol=1e-3)
