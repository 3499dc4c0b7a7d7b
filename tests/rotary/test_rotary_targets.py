"""Target rules of the rotary ops (spec 2.3) through geir.check."""

from __future__ import annotations

import pytest

import geir
from geir import GraphError
from rotary.helpers import ROPE, ROPE_GRAD, empty_grad_slices_expected, rotary_graph

ALL = ("ascend910b", "ascend910_93", "ascend950")


def test_valid_grad_passes_on_ascend950_only():
    g = rotary_graph(ROPE_GRAD, (2, 4, 8, 128), (1, 4, 1, 128), "float16", rotary_mode=1, partial_slice=[0, 128])
    report = geir.check(g, target="ascend950")
    assert report.ok and len(report) == 0 and "ok" in str(report)
    for target in ("ascend910b", "ascend910_93"):
        report = geir.check(g, target=target)
        assert not report.ok and report.rules() == {"RP-T1"}
        (v,) = report.violations
        assert v.node == "node" and v.op_type == ROPE_GRAD
        assert v.message.startswith(f"[RP-T1] {ROPE_GRAD} 'node' on {target}: op: expected a target with")
        assert f"got {target}" in v.message and "helpers.py" in str(v)


def test_default_mode_fails_rp_t2_everywhere():
    g = rotary_graph(ROPE_GRAD, (2, 2, 2, 8), (1, 2, 1, 8), partial_slice=[0, 8])
    report = geir.check(g, target="ascend950")
    assert report.rules() == {"RP-T2"}
    assert "attribute 'rotary_mode': expected 1 (interleave: the only mode with a kernel), got 0" in str(report)
    f = rotary_graph(ROPE, (2, 2, 2, 8), (2, 1, 1, 8), partial_slice=[0, 8])
    for target in ALL:
        assert "RP-T2" in geir.check(f, target=target).rules()


@empty_grad_slices_expected
def test_e4_default_attributes_are_valid_but_fail_every_target():
    g = rotary_graph(ROPE_GRAD, (2, 2, 2, 8), (1, 2, 1, 4))  # mode 0, slice [0, 0]
    assert not geir.check(g, target="ascend950").ok
    assert not geir.check(g, target="ascend910b").ok


def test_head_dim_limits():
    g = rotary_graph(ROPE_GRAD, (1, 1, 1, 2048), (1, 1, 1, 64), rotary_mode=1, partial_slice=[0, 64])
    report = geir.check(g, target="ascend950")
    assert report.rules() == {"RP-T3"} and "input 0 'dy' dim 3: expected D <= 1024, got 2048" in str(report)
    f = rotary_graph(ROPE, (2, 1, 1, 2048), (2, 1, 1, 64), rotary_mode=1, partial_slice=[0, 64])
    assert geir.check(f, target="ascend910b").rules() == {"RP-T3"}
    empty = rotary_graph(ROPE, (2, 1, 1, 2048), (2, 1, 1, 0), rotary_mode=1, partial_slice=[8, 8])
    assert geir.check(empty, target="ascend910b").ok  # forward rules apply when L > 0


def test_odd_head_dim_rp_t4():
    f = rotary_graph(ROPE, (2, 1, 1, 33), (2, 1, 1, 32), rotary_mode=1, partial_slice=[0, 32])
    for target in ALL:
        report = geir.check(f, target=target)
        assert report.rules() == {"RP-T4"} and "expected an even D, got 33" in str(report)


def test_forward_cos_layout_rp_t5_on_a2_a3_only():
    ok = rotary_graph(ROPE, (2, 4, 8, 64), (2, 4, 1, 64), rotary_mode=1, partial_slice=[0, 64])
    assert all(geir.check(ok, target=t).ok for t in ALL)
    bad_b = rotary_graph(ROPE, (2, 4, 8, 64), (1, 4, 1, 64), rotary_mode=1, partial_slice=[0, 64])
    bad_n = rotary_graph(ROPE, (2, 4, 8, 64), (2, 4, 8, 64), rotary_mode=1, partial_slice=[0, 64])
    for g, fact in ((bad_b, "input 1 'cos' dim 0: expected 2 (B, dim 0 of input 0 'x'), got 1"),
                    (bad_n, "input 1 'cos' dim 2: expected 1, got 8")):
        for target in ("ascend910b", "ascend910_93"):
            report = geir.check(g, target=target)
            assert report.rules() == {"RP-T5"} and fact in str(report)
        assert geir.check(g, target="ascend950").ok


def test_unknown_target_lists_the_known_ones():
    g = rotary_graph(ROPE_GRAD, (1, 1, 1, 8), (1, 1, 1, 8), rotary_mode=1, partial_slice=[0, 8])
    with pytest.raises(GraphError, match="unknown target 'ascend310': expected one of ascend910b, ascend910_93, ascend950"):
        geir.check(g, target="ascend310")


def test_report_lists_every_violation_of_a_multi_node_graph():
    b = geir.GraphBuilder("two")
    x = b.input("x", "float32", (2, 4, 8, 64))
    c = b.input("c", "float32", (1, 4, 1, 64))
    y = b.InplacePartialRotaryMul(x, c, c, rotary_mode=0, partial_slice=[0, 64], name="fwd")
    b.output(b.InplacePartialRotaryMulGrad(y, c, c, rotary_mode=0, partial_slice=[0, 64], name="bwd"), "dx")
    report = geir.check(b.build(), target="ascend910b")
    assert [(v.node, v.rule) for v in report] == [("fwd", "RP-T2"), ("fwd", "RP-T5"), ("bwd", "RP-T1")]
    assert str(report).splitlines()[0] == "graph 'two' on ascend910b: refused: 3 error(s), 0 unsupported"
