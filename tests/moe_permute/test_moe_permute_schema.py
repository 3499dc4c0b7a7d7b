"""Schemas, inference, semantic rules (MP-S#, MPG-S#) and target rules (MP-T#, MPG-T#) of MoeTokenPermute(Grad);
each rule's source is recorded in schemas/moe_permute/schema.py and targets.py."""

from __future__ import annotations

import pytest

import geir
from geir import GraphError
from geir.schemas import get_schema
from helpers import assert_rule_error
from moe_permute.helpers import PERMUTE, PERMUTE_GRAD, TOKEN_DTYPES, permute_grad_graph, permute_graph


def _fails(build, rule, *facts, op):
    assert_rule_error(build, rule, *facts, op=op)


def test_schemas_are_cann_op_defs():
    """moe_token_permute_def.cpp / moe_token_permute_grad_def.cpp: names, order, defaults, dtypes."""
    fwd, grad = get_schema(PERMUTE), get_schema(PERMUTE_GRAD)
    assert [i.name for i in fwd.inputs] == ["tokens", "indices"]
    assert [o.name for o in fwd.outputs] == ["permute_tokens", "sorted_indices"]
    assert [(a.name, a.kind.value, a.default) for a in fwd.attributes] == [("num_out_tokens", "Int", 0),
                                                                         ("padded_mode", "Bool", False)]
    assert [i.name for i in grad.inputs] == ["permuted_output_grad", "sorted_indices"]
    assert [o.name for o in grad.outputs] == ["input_grad"]
    assert [(a.name, a.kind.value, a.required) for a in grad.attributes] == [("num_topk", "Int", True),
                                                                           ("padded_mode", "Bool", False)]
    assert len(fwd.type_combinations) == 8 and len(grad.type_combinations) == 3


@pytest.mark.parametrize("dtype", list(TOKEN_DTYPES))
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_inference_for_every_dtype_pair(dtype, index_dtype):
    g = permute_graph((4, 3), (4, 2), dtype, index_dtype)
    assert [str(v.type) for v in g.outputs] == [f"{dtype}[8,3]", "int32[8]"]


@pytest.mark.parametrize("n, rows", [(0, 8), (5, 5), (8, 8), (100, 8), (-3, 5), (-8, 0), (-100, 0)])
def test_rows_follow_num_out_tokens_as_cann_clamps_them(n, rows):
    """tiling/infershape: rows = n + T*K when n <= 0, else n; clamped to [0, T*K]."""
    assert permute_graph((4, 3), (4, 2), num_out_tokens=n).outputs[0].shape == (rows, 3)


def test_one_dimensional_indices_and_higher_rank_tokens():
    assert permute_graph((5, 2, 3), (5,)).outputs[0].shape == (5, 2, 3)
    assert permute_graph((0, 4), (0, 2)).outputs[0].shape == (0, 4)      # empty tensors: CANN's docs allow them


def test_symbolic_shapes_infer():
    b = geir.GraphBuilder("sym")
    rows, s = b.MoeTokenPermute(b.input("x", "float32", ("T", 16)), b.input("e", "int32", ("T", 4)), name="p")
    assert rows.shape == ("p_slots", 16) and s.shape == ("p_slots",)      # T * K: a symbol of the node
    rows, _ = b.MoeTokenPermute(b.input("z", "float32", ("T", 16)), b.input("h", "int32", ("T", 4)), name="n",
                                num_out_tokens=3)
    assert rows.shape == ("n_rows", 16)
    rows, s = b.MoeTokenPermute(b.input("y", "float32", ("T", 16)), b.input("f", "int32", ("T",)), name="q")
    assert rows.shape == ("T", 16) and s.shape == ("T",)
    dx = b.MoeTokenPermuteGrad(b.input("g", "float32", ("R", 16)), b.input("s", "int32", ("M",)), num_topk=4, name="r")
    assert dx.shape == ("r_tokens", 16)


def test_forward_rules():
    _fails(lambda: permute_graph((4,), (4, 2)), "MP-S1", "input 0 'tokens'", "expected rank >= 2", op=PERMUTE)
    _fails(lambda: permute_graph((4, 3), (4, 2, 1)), "MP-S1", "input 1 'indices'", "rank 1 (tokens,) or 2", op=PERMUTE)
    _fails(lambda: permute_graph((4, 3), (5, 2)), "MP-S2", "input 1 'indices' dim 0", "expected 4 (tokens", "got 5",
           op=PERMUTE)
    _fails(lambda: permute_graph((4, 3), (4, 2), padded_mode=True), "MP-S3", "attribute 'padded_mode'",
           "padded_mode=True is not supported", op=PERMUTE)
    _fails(lambda: permute_graph((4, 3), (4, 2), "float64"), "SCH-5", "input 0 'tokens'", op=PERMUTE)
    _fails(lambda: permute_graph((4, 3), (4, 2), index_dtype="int16"), "SCH-5", "input 1 'indices'", op=PERMUTE)


def test_grad_rules():
    _fails(lambda: permute_grad_graph(8, 3, 8), "SCH-4", "attribute 'num_topk'", op=PERMUTE_GRAD)
    _fails(lambda: permute_grad_graph(8, 3, 8, num_topk=0), "MPG-S2", "attribute 'num_topk'", "got 0", op=PERMUTE_GRAD)
    _fails(lambda: permute_grad_graph(8, 3, 7, num_topk=2), "MPG-S2", "input 1 'sorted_indices' dim 0",
           "a multiple of num_topk = 2", "got 7", op=PERMUTE_GRAD)
    _fails(lambda: permute_grad_graph(8, 3, 8, num_topk=2, padded_mode=True), "MPG-S3", "padded_mode", op=PERMUTE_GRAD)
    b = geir.GraphBuilder("g")
    with pytest.raises(GraphError, match=r"\[MPG-S1\] .*input 0 'permuted_output_grad': expected rank 2"):
        b.MoeTokenPermuteGrad(b.input("g", "float32", (8,)), b.input("s", "int32", (8,)), num_topk=2)
    g = permute_grad_graph(5, 3, 8, num_topk=2)                # R < M: rows >= R were dropped
    assert g.outputs[0].shape == (4, 3)


@pytest.mark.parametrize("target, graph, rules", [
    ("ascend910b", lambda: permute_graph((4, 8), (4, 2)), set()),
    ("ascend950", lambda: permute_graph((4, 8), (4, 2), "int8"), set()),
    ("ascend910_93", lambda: permute_graph((4, 8), (4, 2), "int8"), {"MP-T4"}),
    ("ascend910b", lambda: permute_graph((2, 8), (2, 513)), {"MP-T2"}),
    ("ascend950", lambda: permute_graph((2, 8), (2, 513)), set()),
    ("ascend910b", lambda: permute_graph((16777215, 1), (16777215,)), {"MP-T3"}),
    ("ascend310p", lambda: permute_graph((4, 8), (4, 2)), {"MP-T1"}),
    ("ascend910_93", lambda: permute_grad_graph(8, 4, 8, num_topk=2), set()),
    ("ascend950", lambda: permute_grad_graph(8, 4, 8, num_topk=2), {"MPG-T1"}),
    ("ascend910b", lambda: permute_grad_graph(513, 4, 513, num_topk=513), {"MPG-T2"}),
])
def test_target_rules(target, graph, rules):
    report = geir.check(graph(), target)
    assert report.rules() == rules, str(report)


def test_target_levels_follow_their_sources():
    """MP-T1/T2/T3 and MPG-T1: code (op def, tiling) -> error; MP-T4, MPG-T2: the docs only -> unsupported."""
    levels = {v.rule: v.level for target, graph in [
        ("ascend910_93", permute_graph((2, 8), (2, 513), "int8")), ("ascend310p", permute_graph((4, 8), (4, 2))),
        ("ascend950", permute_grad_graph(8, 4, 8, num_topk=2)), ("ascend910b", permute_grad_graph(513, 4, 513, num_topk=513)),
    ] for v in geir.check(graph, target).violations}
    assert levels == {"MP-T2": "error", "MP-T4": "unsupported", "MP-T1": "error", "MPG-T1": "error",
                      "MPG-T2": "unsupported"}
