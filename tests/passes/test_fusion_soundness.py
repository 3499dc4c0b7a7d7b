"""geir.fuse never changes what a graph computes (issue 23 items 1-4, 23 and 26): the near variants the matchers
once accepted, fed indices with Gather's meaning, int64 indices beyond int32, graphs that must still export, and
a pass whose work is linear in the graph's size."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.ir._core import Graph
from geir.testing import reference
from helpers import BIG, ints, onnx_slice

RUNTIMES = ("numpy", "onnxruntime")


def _stack_flat(b, first, second, axis, shape):
    """Concat(Unsqueeze(first, axis), Unsqueeze(second, axis), -1) reshaped to ``shape``: stack + flatten when
    ``axis`` is the new last axis, another permutation otherwise."""
    parts = [b.op("Unsqueeze", v, ints(b, [axis])) for v in (first, second)]
    return b.op("Reshape", b.op("Concat", *parts, axis=-1), ints(b, list(shape)))


def _interleaved(backward: bool, axis: int, shape=(1, 2, 3, 8)):
    b = geir.GraphBuilder("interleaved")
    x = b.input("x", "float32", shape)
    cos, sin = b.input("cos", "float32", (1, 2, 1, 8)), b.input("sin", "float32", (1, 2, 1, 8))
    if backward:
        m = b.op("Mul", x, sin)
        moved = _stack_flat(b, onnx_slice(b, m, 1, BIG, 2), b.op("Neg", onnx_slice(b, m, 0, BIG, 2)), axis, shape)
        y = b.op("Add", b.op("Mul", x, cos), moved)
    else:
        rotated = _stack_flat(b, b.op("Neg", onnx_slice(b, x, 1, BIG, 2)), onnx_slice(b, x, 0, BIG, 2), axis, shape)
        y = b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))
    b.output(y, "y")
    return b.build()


@np.errstate(invalid="ignore")                          # a softmax over -inf only is NaN, in both graphs
def _same(original: Graph, fused: Graph, feeds: dict, atol: float = 1e-6) -> None:
    want, got = reference(original, feeds, rounded=False), reference(fused, feeds, rounded=False)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=atol)
    for runtime in RUNTIMES:
        a, c = geir.run(original, feeds, runtime=runtime), geir.run(fused, feeds, runtime=runtime)
        for name in a:
            np.testing.assert_allclose(c[name].astype(np.float64), a[name].astype(np.float64), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("backward", [False, True])
def test_interleaved_rope_stacked_on_another_axis_is_not_fused(backward):
    """Item 1: Unsqueeze on axis 3 makes Concat + Reshape the rotate_half permutation, not rotate_every_two."""
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 2, 3, 8)).astype(np.float32),
             "cos": rng.standard_normal((1, 2, 1, 8)).astype(np.float32),
             "sin": rng.standard_normal((1, 2, 1, 8)).astype(np.float32)}
    for axis, fuses in ((3, False), (-1, True), (4, True)):
        original = _interleaved(backward, axis)
        fused, report = geir.fuse(original)
        ops = [n.op_type for n in fused.nodes]
        assert (ops == ["InplacePartialRotaryMul" + ("Grad" if backward else "")]) == fuses, (axis, ops)
        if not fuses:
            assert any("not the last axis" in m.reason for m in report.near_misses), str(report)
        _same(original, fused, feeds)


def _attention(masked: str, idx_fed: bool = True, dtype: str = "int64", t1: int = 4, n1: int = 4, indices=None):
    """Attention over gathered keys; ``masked``: "" none, "row" Where(Unsqueeze(idx >= 0, 1), ...), "head" the same
    mask without the Unsqueeze (valid only as T1 == N1: it masks by head)."""
    b = geir.GraphBuilder("gathered_attention")
    q, k, v = b.input("q", "float16", (t1, n1, 8)), b.input("k", "float16", (6, 8)), b.input("v", "float16", (6, 4))
    idx = b.input("idx", dtype, (t1, 3)) if idx_fed else b.constant("idx", np.asarray(indices, dtype))
    zero = b.constant("zero", np.array(0, dtype))
    rows = b.op("Max", idx, zero) if masked else idx
    scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", b.op("Gather", k, rows, axis=0), perm=[0, 2, 1])),
                  b.constant("scale", np.array(0.5, np.float16)))
    if masked:
        valid = b.op("GreaterOrEqual", idx, zero)
        valid = b.op("Unsqueeze", valid, ints(b, [1])) if masked == "row" else valid
        scores = b.op("Where", valid, scores, b.constant("minus_inf", np.array(-np.inf, np.float16)))
    b.output(b.op("MatMul", b.op("Softmax", scores, axis=-1), b.op("Gather", v, rows, axis=0)), "out")
    return b.build()


def _attention_feeds(idx, t1=4, n1=4):
    rng = np.random.default_rng(1)
    return {"q": rng.standard_normal((t1, n1, 8)).astype(np.float16),
            "k": rng.standard_normal((6, 8)).astype(np.float16),
            "v": rng.standard_normal((6, 4)).astype(np.float16), "idx": np.asarray(idx, np.int64)}


def test_a_mask_that_broadcasts_by_head_is_not_fused():
    """Item 2: without the Unsqueeze, a (T1, K) mask over (T1, N1, K) scores masks by head when T1 == N1."""
    original = _attention("head")
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert "SparseFlashAttention" not in [n.op_type for n in fused.nodes]
    assert "broadcasts by head" in report.near_misses[0].reason
    _same(original, fused, _attention_feeds([[0, 1, -1], [2, -1, -1], [3, 4, 5], [5, -1, -1]]))
    fused, _ = geir.fuse(_attention("row"), allow_stricter_data=True)
    assert "SparseFlashAttention" in [n.op_type for n in fused.nodes]


def test_fed_indices_keep_the_meaning_of_gather():
    """Item 3: ONNX Gather reads -1 as the last key (and -T2 as the first); the fused op must too, not as padding."""
    original = _attention("")
    fused, _ = geir.fuse(original, allow_stricter_data=True)
    assert "SparseFlashAttention" in [n.op_type for n in fused.nodes]
    _same(original, fused, _attention_feeds([[0, 1, -1], [2, 3, -6], [-2, 3, 1], [5, 0, 3]]))
    original = _attention("row")                       # masked: padding anywhere, any negative; a row of it is NaN
    fused, _ = geir.fuse(original, allow_stricter_data=True)
    assert "SparseFlashAttention" in [n.op_type for n in fused.nodes]
    _same(original, fused, _attention_feeds([[-1, 1, 4], [2, -7, -1], [-1, -1, -1], [5, 0, 3]]))
    original = _moe(fed=True, dtype="int32")
    fused, _ = geir.fuse(original, allow_stricter_data=True)
    assert "MoeTokenUnpermute" in [n.op_type for n in fused.nodes]
    _same(original, fused, _moe_feeds([-6, 4, 3, -1, 1, 2]))


def _moe(fed: bool, dtype: str, probs: bool = True, topk: int = 2, tokens: int = 3, b=None, suffix: str = ""):
    own = b is None
    b = geir.GraphBuilder("moe") if own else b
    permuted = b.input("permuted" + suffix, "float32", (tokens * topk, 4))
    idx = b.input("idx" + suffix, dtype, (tokens * topk,)) if fed else \
        b.constant("idx" + suffix, np.arange(tokens * topk, dtype=dtype)[::-1].copy())
    rows = b.op("Reshape", b.op("Gather", permuted, idx, axis=0), ints(b, [tokens, topk, 4]))
    if probs:
        rows = b.op("Mul", rows, b.op("Unsqueeze", b.input("probs" + suffix, "float32", (tokens, topk)), ints(b, [-1])))
    y = b.op("ReduceSum", rows, ints(b, [1]), keepdims=0)
    if not own:
        return y
    b.output(y, "y")
    return b.build()


def _moe_feeds(idx, dtype=np.int32, suffix: str = ""):
    rng = np.random.default_rng(2)
    return {"permuted" + suffix: rng.standard_normal((6, 4)).astype(np.float32),
            "idx" + suffix: np.asarray(idx, dtype), "probs" + suffix: rng.uniform(0.1, 1, (3, 2)).astype(np.float32)}


def test_int64_indices_beyond_int32_fail_as_the_original_does():
    """Item 4: a fed 2**32 + r must not wrap to r in the cast to the op's int32: both graphs fail on every runtime."""
    cases = [(_moe(fed=True, dtype="int64"), _moe_feeds([0, 2 ** 32 + 1, 2, 3, 4, 5], np.int64)),
             (_attention(""), _attention_feeds([[0, 1, 2 ** 32 + 3], [2, 3, 4], [1, 4, 5], [5, 0, 3]])),
             (_attention("row"), _attention_feeds([[0, 1, 2 ** 32 + 3], [2, 3, 4], [1, 4, 5], [5, 0, 3]]))]
    for original, feeds in cases:
        fused, _ = geir.fuse(original, allow_stricter_data=True)
        assert fused.nodes[-1].op_type in ("MoeTokenUnpermute", "SparseFlashAttention", "Where")
        for runtime in RUNTIMES:
            with pytest.raises(geir.ExecutionError):
                geir.run(original, feeds, runtime=runtime)
            with pytest.raises(geir.ExecutionError):
                geir.run(fused, feeds, runtime=runtime)
        with pytest.raises(geir.ExecutionError):
            reference(fused, feeds)
        assert [n.op_type for n in fused.nodes].count("Clip") == 1           # saturated, then cast


def test_fused_graphs_still_export_and_run_on_onnxruntime():
    """Item 26: an unpermute with probs and one without (K = 1) once fused to two forms of one ONNX function."""
    b = geir.GraphBuilder("two_unpermutes")
    b.output(_moe(True, "int32", probs=True, b=b), "y")
    b.output(_moe(True, "int32", probs=False, topk=1, tokens=6, b=b, suffix="_1"), "y1")
    original = b.build()
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert [n.op_type for n in fused.nodes].count("MoeTokenUnpermute") == 2 and not report.near_misses
    geir.to_onnx(fused)
    feeds = _moe_feeds([5, 4, 3, 2, 1, 0]) | {"permuted_1": np.ones((6, 4), np.float32),
                                              "idx_1": np.arange(6, dtype=np.int32)}
    _same(original, fused, feeds)
    b = geir.GraphBuilder("with_one_of_ours")             # the graph already holds the op without probs
    mine = b.MoeTokenUnpermute(b.input("p", "float32", (6, 4)), b.input("s", "int32", (6,)))
    b.output(mine, "mine")
    b.output(_moe(True, "int32", probs=True, b=b), "y")
    original = b.build()
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert [n.op_type for n in fused.nodes].count("MoeTokenUnpermute") == 1
    assert "could no longer be exported" in report.near_misses[0].reason
    geir.to_onnx(fused)
    feeds = _moe_feeds([5, 4, 3, 2, 1, 0]) | {"p": np.ones((6, 4), np.float32), "s": np.arange(6, dtype=np.int32)}
    _same(original, fused, feeds)


def test_fusion_work_is_linear_in_the_graph_size(monkeypatch):
    """Item 23: the pass sorts the graph once per sweep and never rebuilds it per match (it did: 4x the ropes cost
    20x the time). Counted, not timed: ``geir bench fuse`` has the times."""
    calls = {"order": 0}
    plain = Graph.topological_order

    def counted(self):
        calls["order"] += 1
        return plain(self)
    monkeypatch.setattr(Graph, "topological_order", counted)
    for ropes in (4, 32):
        b = geir.GraphBuilder("ropes")
        cos, sin = b.input("cos", "float32", (1, 2, 1, 8)), b.input("sin", "float32", (1, 2, 1, 8))
        for i in range(ropes):
            x = b.input(f"x{i}", "float32", (1, 2, 3, 8))
            rotated = b.op("Concat", b.op("Neg", onnx_slice(b, x, 4, BIG)), onnx_slice(b, x, 0, 4), axis=-1)
            b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin)), f"y{i}")
        graph = b.build()
        calls["order"] = 0
        fused, report = geir.fuse(graph)
        assert len(report.fused) == ropes and len(fused.nodes) == ropes
        assert calls["order"] <= 8, (ropes, calls)          # copy, sweeps, builds: a constant, not per match


def test_the_pass_runs_the_ops_data_rules_on_constant_inputs(monkeypatch):
    """Whatever a pattern checked: a match whose op refuses its constant inputs on every run is a near miss."""
    from geir.schemas import patterns

    def careless(view, reduce):            # the MoE match, with indices no permutation, unchecked
        gather = reduce.inputs[0].producer.inputs[0].producer
        return patterns.Match("MoeTokenUnpermute", [gather.inputs[0], gather.inputs[1], None], {},
                              reduce.outputs[0], [reduce], constants={1: np.array([0, 0, 1, 2, 3, 4], np.int32),
                                                                      2: np.ones((6, 1), np.float32)})
    from geir.passes import fusion
    monkeypatch.setattr(fusion, "patterns", lambda: (patterns.Pattern("careless", "ReduceSum", careless),))
    original = _moe(fed=True, dtype="int32", probs=False, topk=1, tokens=6)
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert "MoeTokenUnpermute" not in [n.op_type for n in fused.nodes]
    assert "[MU-D1]" in report.near_misses[0].reason and "data rules" in report.near_misses[0].reason


def test_geir_bench_has_a_fusion_suite():
    """Item 23's measurement: ``geir bench fuse`` times geir.fuse on 10, 100 (and 1,000) ropes, per node."""
    from geir.tools.bench import SUITES

    rows = SUITES["fuse"](True)
    assert [r.name for r in rows] == ["10 ropes (70 nodes)", "100 ropes (700 nodes)"]
    assert rows[0].baseline and rows[1].targets == (("10 ropes (70 nodes)", 2.0),)
    fused, report = rows[0].fn()
    assert len(report.fused) == 10 and [n.op_type for n in fused.nodes] == ["InplacePartialRotaryMul"] * 10


@pytest.mark.parametrize("kind", ["moe", "attention"])
def test_fed_indices_that_our_op_checks_more_strictly_fuse_only_when_allowed(kind):
    """A key id twice in a row (attention) or indices that are no permutation (MoE) run in the subgraph and are
    refused by our op: by default the match is a near miss naming the input, and the graph computes as before;
    allow_stricter_data=True fuses it, and such data is then an ExecutionError, never another result."""
    original = _moe(fed=True, dtype="int64") if kind == "moe" else _attention("row")
    op = "MoeTokenUnpermute" if kind == "moe" else "SparseFlashAttention"
    fused, report = geir.fuse(original)
    assert op not in [n.op_type for n in fused.nodes]
    assert any("allow_stricter_data=True" in m.reason for m in report.near_misses), str(report)
    allowed, report = geir.fuse(original, allow_stricter_data=True)
    assert op in [n.op_type for n in allowed.nodes], str(report)
    feeds = (_moe_feeds([0, 0, 1, 2, 3, 4], np.int64) if kind == "moe"
             else _attention_feeds([[0, 0, 1], [2, 3, -1], [4, 4, 4], [5, 1, 3]]))
    for runtime in ("numpy", "onnxruntime"):
        want = geir.run(original, feeds, runtime=runtime)
        got = geir.run(fused, feeds, runtime=runtime)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
        with pytest.raises(geir.ExecutionError):
            geir.run(allowed, feeds, runtime=runtime)


def test_a_zero_weight_on_a_non_finite_row_keeps_the_subgraphs_nan():
    """The op skips a slot of weight 0 (CANN); the subgraph multiplies its row by 0, which is NaN for an inf row.
    With fed probs the match is a near miss by default, and the graph keeps the subgraph's NaN."""
    original = _moe(fed=False, dtype="int64")
    feeds = {k: v for k, v in _moe_feeds([0], np.int64).items() if k != "idx"}
    feeds["permuted"][5, 1] = np.inf                       # the constant idx reads row 5 at slot 0
    feeds["probs"][0, 0] = 0.0
    fused, report = geir.fuse(original)
    assert "MoeTokenUnpermute" not in [n.op_type for n in fused.nodes]
    assert "skips a slot of weight 0" in report.near_misses[0].reason
    for runtime in RUNTIMES:
        got = geir.run(fused, feeds, runtime=runtime)["y"]
        assert np.isnan(got[0, 1]) and np.isfinite(np.delete(got[0], 1)).all()
    allowed, _ = geir.fuse(original, allow_stricter_data=True)   # the op's meaning, asked for
    assert "MoeTokenUnpermute" in [n.op_type for n in allowed.nodes]
    unweighted = _moe(fed=False, dtype="int64", probs=False)   # weights of one: nothing skipped, fused by default
    fused, _ = geir.fuse(unweighted)
    assert "MoeTokenUnpermute" in [n.op_type for n in fused.nodes]
    _same(unweighted, fused, {"permuted": feeds["permuted"]})


def test_padding_that_gathers_a_non_finite_value_row_keeps_the_subgraphs_nan():
    """Masked attention gathers row 0 for a padded entry and multiplies it by probability 0: NaN when v[0] is not
    finite, where the op skips the entry. A constant idx with padding is a near miss by default; without it fuses."""
    padded = _attention("row", idx_fed=False, indices=[[1, 2, -1], [3, -1, -1], [3, 4, 5], [5, 1, 2]])
    feeds = {k: v for k, v in _attention_feeds([[0]]).items() if k != "idx"}
    feeds["v"][0] = np.inf
    fused, report = geir.fuse(padded)
    assert "SparseFlashAttention" not in [n.op_type for n in fused.nodes]
    assert any("skips a padded entry" in m.reason for m in report.near_misses), str(report)
    for runtime in RUNTIMES:
        assert np.isnan(geir.run(fused, feeds, runtime=runtime)["out"][:2]).all()
    full = _attention("row", idx_fed=False, indices=[[1, 2, 0], [3, 4, 0], [3, 4, 5], [5, 1, 2]])
    fused, _ = geir.fuse(full)
    assert "SparseFlashAttention" in [n.op_type for n in fused.nodes]
    _same(full, fused, feeds)


def test_a_constant_row_scatter_that_is_no_permutation_is_a_near_miss():
    """rows written to their slots by ScatterND with a constant row2slot that repeats a slot: the op would refuse
    it on every run (MU-D1) where the subgraph runs, so it is not fused."""
    b = geir.GraphBuilder("scatter")
    permuted = b.input("permuted", "float32", (4, 3))
    slots = b.constant("row2slot", np.array([0, 1, 2, 2], np.int64))
    placed = b.op("ScatterND", b.constant("zeros", np.zeros((4, 3), np.float32)),
                  b.op("Unsqueeze", slots, ints(b, [-1])), permuted)
    b.output(b.op("ReduceSum", b.op("Reshape", placed, ints(b, [2, 2, 3])), ints(b, [1]), keepdims=0), "y")
    fused, report = geir.fuse(b.build(), allow_stricter_data=True)
    assert "MoeTokenUnpermute" not in [n.op_type for n in fused.nodes]
    assert "not a permutation" in report.near_misses[0].reason


def test_a_rope_whose_table_shapes_symbols_leave_undecided_is_not_fused_by_default():
    """cos (B, S, 1, D) and sin (1, S, 1, D): the subgraph broadcasts sin over any B, the op needs cos and sin of
    one shape (RP-S2), which a symbolic B leaves undecided; fused, every run with B != 1 would fail."""
    b = geir.GraphBuilder("rope")
    x = b.input("x", "float32", ("B", 4, 3, 8))
    cos, sin = b.input("cos", "float32", ("B", 4, 1, 8)), b.input("sin", "float32", (1, 4, 1, 8))
    rotated = b.op("Concat", b.op("Neg", onnx_slice(b, x, 4, BIG)), onnx_slice(b, x, 0, 4), axis=-1)
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin)), "y")
    original = b.build()
    fused, report = geir.fuse(original)
    assert "InplacePartialRotaryMul" not in [n.op_type for n in fused.nodes]
    assert "depend on symbolic dims" in report.near_misses[0].reason and "RP-S2" in report.near_misses[0].reason
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 4, 3, 8)).astype(np.float32),
             "cos": rng.standard_normal((2, 4, 1, 8)).astype(np.float32),
             "sin": rng.standard_normal((1, 4, 1, 8)).astype(np.float32)}
    _same(original, fused, feeds)
    allowed, _ = geir.fuse(original, allow_stricter_data=True)      # fused: such shapes refused when it runs
    assert "InplacePartialRotaryMul" in [n.op_type for n in allowed.nodes]
    for runtime in RUNTIMES:
        with pytest.raises(geir.ExecutionError, match="RP-S2"):
            geir.run(allowed, feeds, runtime=runtime)


def test_index_rows_that_broadcast_over_the_query_rows_are_not_fused():
    """idx (1, K) over T1 = 2 query rows: MatMul broadcasts it, the op takes one index row per query row (fused, the
    graph failed on every input, even with allow_stricter_data)."""
    b = geir.GraphBuilder("broadcast_idx")
    q, k, v = b.input("q", "float16", (2, 2, 4)), b.input("k", "float16", (5, 4)), b.input("v", "float16", (5, 3))
    idx = b.input("idx", "int64", (1, 4))
    scores = b.op("MatMul", q, b.op("Transpose", b.op("Gather", k, idx, axis=0), perm=[0, 2, 1]))
    scores = b.op("Mul", scores, b.constant("c", np.array(0.5, np.float16)))
    b.output(b.op("MatMul", b.op("Softmax", scores, axis=-1), b.op("Gather", v, idx, axis=0)), "y")
    fused, report = geir.fuse(b.build(), allow_stricter_data=True)
    assert "SparseFlashAttention" not in [n.op_type for n in fused.nodes]
    assert "broadcast over the 2 query rows" in report.near_misses[0].reason
