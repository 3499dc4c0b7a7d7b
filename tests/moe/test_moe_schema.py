"""Schemas, semantic rules and target rules of the MoE unpermute ops (spec 3.1, 3.2)."""

from __future__ import annotations

import pytest

import geir
from geir import GraphError
from geir.schemas import get_schema
from helpers import assert_rule_error
from moe.helpers import MOE, MOE_GRAD, bf16_tokens_f32_probs_expected, moe_grad_graph, moe_graph

DTYPES = ("bfloat16", "float16", "float32")


def _fails(build, rule, *facts, op):
    assert_rule_error(build, rule, *facts, op=op, built_at="helpers.py:")


def test_schemas_match_the_contract_tables():
    fwd, grad = get_schema(MOE), get_schema(MOE_GRAD)
    assert [(i.name, i.optional) for i in fwd.inputs] == [
        ("permuted_tokens", False), ("sorted_indices", False), ("probs", True)]
    assert [(i.name, i.optional) for i in grad.inputs] == [
        ("permuted_tokens", True), ("unpermuted_tokens_grad", False), ("sorted_indices", False), ("probs", True)]
    assert [o.name for o in fwd.outputs] == ["unpermuted_tokens"]
    assert [(o.name, o.optional) for o in grad.outputs] == [("permuted_tokens_grad", False), ("probs_grad", False)]
    assert [(a.name, a.kind.value, a.default) for a in fwd.attributes] == [
        ("padded_mode", "Bool", False), ("restore_shape", "ListInt", ())]
    assert [(a.name, a.kind.value, a.default) for a in grad.attributes] == [
        ("padded_mode", "Bool", False), ("restore_shape", "ListInt", (1, 1))]
    assert len(fwd.type_combinations) == 9 and len(grad.type_combinations) == 9


@pytest.mark.parametrize("tt", DTYPES)
@pytest.mark.parametrize("tp", DTYPES)
@bf16_tokens_f32_probs_expected
def test_inference_for_all_nine_dtype_pairs(tt, tp):
    g = moe_graph(6, 5, 6, (3, 2), tt, tp)
    assert g.outputs[0].type == geir.TensorType(tt, (3, 5))
    g = moe_grad_graph((6, 5), (3, 5), 6, (3, 2), tt, tp)
    assert [str(v.type) for v in g.outputs] == [f"{tt}[6,5]", f"{tp}[3,2]"]


def test_inference_without_probs():
    assert moe_graph(4, 3, 4).outputs[0].shape == (4, 3)
    assert moe_graph(2, 3, 5).outputs[0].shape == (5, 3)  # rows != slots: rows >= R are dropped slots
    g = moe_grad_graph(None, (4, 3), 4, dtype="bfloat16")
    assert [str(v.type) for v in g.outputs] == ["bfloat16[4,3]", "bfloat16[4,1]"]


def test_symbolic_tokens_infer():
    b = geir.GraphBuilder("sym")
    p = b.input("p", "float32", ("M", 16))
    s = b.input("s", "int32", ("M",))
    pr = b.input("pr", "float32", ("T", 4))
    assert b.MoeTokenUnpermute(p, s, pr).shape == ("T", 16)


def test_forward_rules():
    _fails(lambda: moe_graph(6, 5, 6, (3, 2, 1)), "MU-S1", "input 2 'probs'", "expected rank 2 (tokens, topK), got rank 3",
           op=MOE)
    b = geir.GraphBuilder("g")
    p = b.input("p", "float32", (6,))
    s = b.input("s", "int32", (6,))
    with pytest.raises(GraphError, match=r"\[MU-S1\] .*input 0 'permuted_tokens': expected rank 2 \(rows, hidden\), got rank 1"):
        b.MoeTokenUnpermute(p, s)
    _fails(lambda: moe_graph(6, 5, 7, (3, 2)), "MU-S2", "input 1 'sorted_indices' dim 0",
           "expected tokens * topK = 3 * 2 = 6 (one row index per slot), got 7", op=MOE)
    # MU-S3 (padded_mode=True an error) became the warning MU-W1 and the device rows MU-T5 (issue 27, item 3):
    # tests/moe/test_moe_upstream_rules.py
    assert moe_graph(6, 5, 6, (3, 2), restore_shape=[9, 9]).nodes[0].attributes["restore_shape"] == (9, 9)


def test_forward_accepts_zero_size_tensors():
    assert moe_graph(0, 5, 0, (0, 2)).outputs[0].shape == (0, 5)
    assert moe_graph(4, 0, 4).outputs[0].shape == (4, 0)


def test_grad_rules():
    _fails(lambda: moe_grad_graph((6, 5), (3, 5, 1), 6, (3, 2)), "MG-S1", "input 1 'unpermuted_tokens_grad'",
           "got rank 3", op=MOE_GRAD)
    _fails(lambda: moe_grad_graph((6, 5), (3, 5), 6, (4, 2)), "MG-S1", "input 3 'probs' dim 0",
           "expected 3 (tokens, dim 0 of input 1 'unpermuted_tokens_grad'), got 4", op=MOE_GRAD)
    _fails(lambda: moe_grad_graph((6, 5), (3, 5), 8, (3, 2)), "MG-S2", "expected tokens * topK = 3 * 2 = 6", "got 8",
           op=MOE_GRAD)
    _fails(lambda: moe_grad_graph(None, (10, 64), 30), "MG-S2", "expected tokens * topK = 10 * 1 = 10", "got 30",
           op=MOE_GRAD)  # CANN's no-probs UT shape (spec 3.6)
    _fails(lambda: moe_grad_graph((7, 5), (3, 5), 6, (3, 2)), "MG-S3", "input 0 'permuted_tokens' dim 0",
           "expected 6 (len(sorted_indices)), got 7", op=MOE_GRAD)
    _fails(lambda: moe_grad_graph((6, 4), (3, 5), 6, (3, 2)), "MG-S3", "input 0 'permuted_tokens' dim 1",
           "expected 5 (hidden size of input 1 'unpermuted_tokens_grad'), got 4", op=MOE_GRAD)
    _fails(lambda: moe_grad_graph(None, (3, 5), 6, (3, 2)), "MG-S4", "input 0 'permuted_tokens': expected a value when "
           "probs is given, got None", op=MOE_GRAD)
    _fails(lambda: moe_grad_graph((6, 0), (3, 0), 6, (3, 2)), "MG-S5", "input 1 'unpermuted_tokens_grad' dim 1",
           "expected a non-zero extent, got 0", op=MOE_GRAD)
    _fails(lambda: moe_grad_graph((0, 5), (0, 5), 0, (0, 2)), "MG-S5", "dim 0", op=MOE_GRAD)
    # MG-S6 became MG-W1 and MG-T3 (issue 27, item 3): tests/moe/test_moe_upstream_rules.py
    _fails(lambda: moe_grad_graph((6, 5), (3, 5), 6, (3, 2), index_dtype="int64"), "SCH-5",
           "input 2 'sorted_indices': expected dtype in {int32}, got int64", op=MOE_GRAD)


def test_grad_tokens_and_grad_share_the_token_dtype():
    b = geir.GraphBuilder("g")
    p = b.input("p", "float16", (6, 5))
    dy = b.input("dy", "float32", (3, 5))
    s = b.input("s", "int32", (6,))
    pr = b.input("pr", "float32", (3, 2))
    with pytest.raises(GraphError, match=r"\[SCH-6\] .*dtypes of \(permuted_tokens, unpermuted_tokens_grad, sorted_indices, "
                                         r"probs\): expected one of .*got \(float16, float32, int32, float32\)"):
        b.MoeTokenUnpermuteGrad(p, dy, s, pr)


def test_target_rules():
    # bfloat16/bfloat16: the bfloat16/float32 pair now warns MG-W2 (issue 27), tested in test_moe_upstream_rules.py
    g = moe_grad_graph((30, 64), (10, 64), 30, (10, 3), "bfloat16", "bfloat16")
    assert geir.check(g, "ascend910b").ok and geir.check(g, "ascend910_93").ok
    report = geir.check(g, "ascend950")
    assert report.rules() == {"MG-T1"}
    assert report.violations[0].message.startswith("[MG-T1] MoeTokenUnpermuteGrad 'node' on ascend950: op: ")
    assert "expected a target with a MoeTokenUnpermuteGrad kernel (ascend910b, ascend910_93), got ascend950" in str(report)
    f = moe_graph(600, 8, 600, (1, 600))
    for target in ("ascend910b", "ascend910_93"):
        report = geir.check(f, target)
        assert report.rules() == {"MU-T2"} and "input 2 'probs' dim 1: expected topK <= 512, got 600" in str(report)
    assert geir.check(f, "ascend950").rules() == {"MU-T1"}
    assert geir.check(moe_graph(600, 8, 600), "ascend910b").ok  # no probs: topK = 1
    big = moe_grad_graph((1026, 8), (2, 8), 1026, (2, 513))
    assert geir.check(big, "ascend910b").rules() == {"MG-T2"}
