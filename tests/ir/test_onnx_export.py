"""ONNX export: checker, shape inference, and the function bodies run without geir (ORT, onnx.reference)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

import geir
from geir import GraphError
from helpers import assert_same_graph
from moe.helpers import moe_grad_graph, moe_graph
from oracles.numerics import assert_within_ulps_of_scale, bits_equal
from oracles.onnx_runners import run_onnxruntime, run_reference
from rotary.helpers import ROPE, ROPE_GRAD, empty_grad_slices_expected, rotary_graph
from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase, sfa_graph

NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _random(shape, dtype, seed=0, low=None):
    rng = np.random.default_rng(seed)
    data = rng.uniform(-1, 1, shape) if low is not None else rng.standard_normal(shape)
    return data.astype(NP[dtype] if isinstance(dtype, str) else dtype)


def _export_and_run(graph, feeds):
    model = geir.to_onnx(graph)
    onnx.checker.check_model(model, full_check=True)
    return model, geir.run(graph, feeds), run_onnxruntime(model, feeds), run_reference(model, feeds)


def _assert_close(name, got, want, exact=False):
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    if exact:
        assert bits_equal(got, want), name
    elif want.dtype == np.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.max(np.abs(want)))), err_msg=name)
    else:
        assert_within_ulps_of_scale(got, want.astype(np.float64), want.dtype, ulps=2, what=name)


@pytest.mark.parametrize("op", [ROPE, ROPE_GRAD])
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("dtype, cos_dtype", [("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
                                              ("bfloat16", "float32")])
@empty_grad_slices_expected
def test_rotary_bodies_are_bit_exact(op, mode, dtype, cos_dtype):
    for keep, pslice in ((("B", "S", "N"), (5, 13)), ((), (0, 8)), (("S",), (0, 0))):
        shape = (2, 3, 4, 21) if pslice != (0, 8) else (2, 3, 4, 8)
        length = pslice[1] - pslice[0]
        cos_shape = tuple(d if k in keep else 1 for d, k in zip(shape[:3], "BSN")) + (length if length else 4,)
        attrs = dict(rotary_mode=mode, partial_slice=list(pslice))
        g = rotary_graph(op, shape, cos_shape, dtype, cos_dtype, **attrs)
        feeds = {"x": _random(shape, dtype), "cos": _random(cos_shape, cos_dtype, 1, -1), "sin": _random(cos_shape, cos_dtype, 2, -1)}
        _, ours, ort_out, ref_out = _export_and_run(g, feeds)
        assert bits_equal(ort_out["y"], ours["y"]), (keep, pslice)
        assert bits_equal(ref_out["y"], ours["y"]), (keep, pslice)


def test_rotary_forward_empty_partial_slice_means_whole_axis():
    g = rotary_graph(ROPE, (1, 2, 1, 8), (1, 2, 1, 8), rotary_mode=1, partial_slice=[])
    feeds = {"x": _random((1, 2, 1, 8), "float32"), "cos": _random((1, 2, 1, 8), "float32", 1),
             "sin": _random((1, 2, 1, 8), "float32", 2)}
    _, ours, ort_out, ref_out = _export_and_run(g, feeds)
    assert bits_equal(ort_out["y"], ours["y"]) and bits_equal(ref_out["y"], ours["y"])


@pytest.mark.parametrize("tt, tp", [(t, p) for t in NP for p in NP])
@pytest.mark.parametrize("with_probs", [True, False])
def test_moe_bodies(tt, tp, with_probs):
    tokens, topk, hidden = 5, (3 if with_probs else 1), 7
    m = tokens * topk
    rng = np.random.default_rng(0)
    s = rng.permutation(m).astype(np.int32)
    probs = _random((tokens, topk), tp, 3, -1) if with_probs else None
    if with_probs:
        probs[0, 1] = 0
    rows = m - 2 if with_probs else m            # forward: two dropped slots
    g = moe_graph(rows, hidden, m, probs.shape if with_probs else None, tt, tp)
    feeds = {"tokens": _random((rows, hidden), tt), "indices": s} | ({"probs": probs} if with_probs else {})
    _, ours, ort_out, ref_out = _export_and_run(g, feeds)
    for other in (ort_out, ref_out):
        _assert_close("y", other["y"], ours["y"])
    g = moe_grad_graph((m, hidden) if with_probs else None, (tokens, hidden), m, probs.shape if with_probs else None,
                       tt, tp)
    feeds = {"dy": _random((tokens, hidden), tt, 4), "indices": s}
    if with_probs:
        feeds |= {"tokens": _random((m, hidden), tt, 5), "probs": probs}
    _, ours, ort_out, ref_out = _export_and_run(g, feeds)
    for other in (ort_out, ref_out):
        _assert_close("ptg", other["ptg"], ours["ptg"], exact=True)
        _assert_close("pg", other["pg"], ours["pg"])


SFA_CASES = [dict(layout=layout, mode=mode, bs=bs, Dr=dr, kv_merge=merge, N2=n2, sinks=sinks)
             for layout, mode, bs, dr, merge, n2, sinks in [
                 ("BSND", 3, 1, 0, False, 1, False), ("BSND", 0, 2, 4, True, 2, True), ("TND", 3, 2, 4, False, 1, True),
                 ("TND", 0, 1, 0, True, 2, False), ("BSND", 3, 4, 4, False, 2, False), ("TND", 3, 1, 4, True, 1, False)]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", SFA_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sfa_bodies(dtype, case):
    c = AttentionCase(N1=4, D2=6, dtype=dtype, seed=3, **case)
    a = c.arrays()
    value = a["value"] if a["value"] is not None else a["key"][..., :c.D2].copy()
    g, feeds = sfa_graph(dict(a, value=value), SFA, **c.forward_attrs())
    _, ours, ort_out, ref_out = _export_and_run(g, feeds)
    for other in (ort_out, ref_out):
        for name in ours:
            _assert_close(name, other[name], ours[name])
    grad_feeds = {"query": a["query"], "key": a["key"], "sparse_indices": a["sparse_indices"],
                  "d_out": _random(ours["attention_out"].shape, dtype, 7), "out": ours["attention_out"],
                  "softmax_max": ours["softmax_max"], "softmax_sum": ours["softmax_sum"], "value": a["value"],
                  "query_rope": a["query_rope"], "key_rope": a["key_rope"]}
    if c.layout == "TND":
        grad_feeds |= {k: a[k] for k in ("actual_seq_lengths_query", "actual_seq_lengths_kv")}
    g, feeds = sfa_graph(grad_feeds, SFA_GRAD, **c.grad_attrs())
    _, ours, ort_out, ref_out = _export_and_run(g, feeds)
    for other in (ort_out, ref_out):
        assert set(other) == set(ours)
        for name in ours:
            _assert_close(name, other[name], ours[name])


def test_sfa_forward_without_lse_exports_empty_stats():
    c = AttentionCase(N1=4, dtype="float16")
    a = c.arrays()
    g, feeds = sfa_graph(a, SFA, **dict(c.forward_attrs(), return_softmax_lse=False))
    _, ours, ort_out, _ = _export_and_run(g, feeds)
    assert ort_out["softmax_max"].shape == (0,) and ours["softmax_max"].shape == (0,)


def test_onnx_shape_inference_knows_our_ops_after_import_geir():
    import subprocess
    import sys
    code = ("import geir, onnx\n"
            "from onnx import helper, TensorProto as T\n"
            "n = helper.make_node('MoeTokenUnpermute', ['p', 's'], ['y'], domain='ai.cann')\n"
            "g = helper.make_graph([n], 'g', [helper.make_tensor_value_info('p', T.FLOAT, [6, 4]),\n"
            "    helper.make_tensor_value_info('s', T.INT32, [6])], [helper.make_tensor_value_info('y', T.FLOAT, None)])\n"
            "m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 18), helper.make_opsetid('ai.cann', 1)])\n"
            "out = onnx.shape_inference.infer_shapes(m, strict_mode=True).graph.output[0]\n"
            "print([d.dim_value for d in out.type.tensor_type.shape.dim])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[6, 4]", result.stderr


def test_model_structure_opsets_value_info_and_dim_params():
    g = rotary_graph(ROPE_GRAD, ("B", "S", 4, 16), (1, "S", 1, 8), "float16", rotary_mode=1, partial_slice=[4, 12])
    model = geir.to_onnx(g)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 18), ("ai.cann", 1)}
    (node,) = model.graph.node
    assert (node.domain, node.op_type, node.name) == ("ai.cann", ROPE_GRAD, "node")
    assert list(node.input) == ["x", "cos", "sin"] and list(node.output) == ["y"]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == {"rotary_mode": 1,
                                                                                     "partial_slice": [4, 12]}
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["B", "S", 4, 16]
    (function,) = model.functions
    assert (function.domain, function.name) == ("ai.cann", ROPE_GRAD)
    assert [(o.domain, o.version) for o in function.opset_import] == [("", 18)]
    assert {n.domain for n in function.node} == {""}        # standard ops only


def test_full_value_info_and_our_shape_inference():
    b = geir.GraphBuilder("chain")
    x = b.input("x", "float32", (2, 3, 4, 16))
    c = b.input("c", "float32", (1, 3, 1, 16))
    y = b.InplacePartialRotaryMul(x, c, c, rotary_mode=1, partial_slice=[0, 16], name="fwd")
    t = b.op("Transpose", y, perm=[0, 2, 1, 3])
    b.output(b.InplacePartialRotaryMulGrad(t, b.op("Transpose", c, perm=[0, 2, 1, 3]), b.op("Transpose", c, perm=[0, 2, 1, 3]),
                                           rotary_mode=1, partial_slice=[0, 16], name="bwd"), "dx")
    model = geir.to_onnx(b.build())
    declared = {vi.name: vi for vi in model.graph.value_info}
    assert {"fwd.x", "Transpose_0.transposed"} <= set(declared)
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    del stripped.graph.value_info[:]
    inferred = onnx.shape_inference.infer_shapes(stripped, strict_mode=True)
    got = {vi.name: vi for vi in inferred.graph.value_info}
    for name, vi in declared.items():
        assert got[name].type == vi.type, name
    assert inferred.graph.output[0].type == model.graph.output[0].type


def test_export_refuses_two_bodies_for_one_op():
    b = geir.GraphBuilder("mixed")
    t = b.input("t", "float32", (6, 4))
    s = b.input("s", "int32", (6,))
    p = b.input("p", "float32", (3, 2))
    b.output(b.MoeTokenUnpermute(t, s, p, name="with_probs"), "a")
    b.output(b.MoeTokenUnpermute(t, s, name="without"), "b")
    with pytest.raises(GraphError, match=r"MoeTokenUnpermute 'without': cannot export: its ONNX function body would "
                                         r"differ from the one of 'with_probs' \(no optional inputs vs inputs probs\)"):
        geir.to_onnx(b.build())


def test_save_and_load(tmp_path):
    g = moe_grad_graph((6, 4), (3, 4), 6, (3, 2), "bfloat16", "float32")
    path = tmp_path / "moe_grad.onnx"
    geir.save_onnx(g, path)
    onnx.checker.check_model(str(path), full_check=True)
    assert_same_graph(geir.load_onnx(path), g)
