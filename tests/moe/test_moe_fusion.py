"""geir.fuse on MoE unpermutes: a gather and a weighted sum (with probs unsqueezed or reshaped, or without), and rows
scattered to their slots, become MoeTokenUnpermute and compute what the original did."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from helpers import assert_same_function, ints
from geir.runtimes import runtime_names
from moe.helpers import unpermute_subgraph

RUNTIMES = runtime_names()


@pytest.mark.parametrize("probs, index_dtype", [("unsqueeze", "int32"), ("reshape", "int64"), (None, "int32")])
def test_moe_unpermute_pattern(probs, index_dtype):
    original = unpermute_subgraph(probs, index_dtype)
    fused, report = geir.fuse(original, allow_stricter_data=True)
    ops = [n.op_type for n in fused.nodes]
    normalise = ["Less", "GreaterOrEqual", "And", "Add", "Where"]        # Gather's negative ids, kept
    assert ops == normalise + (["Clip", "Cast"] if index_dtype == "int64" else []) + ["MoeTokenUnpermute"]
    assert fused.nodes[-1].inputs[2] is not None            # without probs: weights of one (K = 2)
    assert report.fused[0].pattern.startswith("MoE unpermute")
    assert_same_function(original, fused)


def test_moe_rows_scattered_to_their_slots_convert_the_index_convention():
    """out[row2slot] = rows (a ScatterND) is the gather by the inverse permutation: fused with CANN's sorted_indices
    computed in the graph."""
    b = geir.GraphBuilder("scatter_unpermute")
    rows = b.input("rows", "float32", (6, 4))
    row2slot = b.input("row2slot", "int64", (6,))
    probs = b.input("probs", "float32", (3, 2))
    placed = b.op("ScatterND", b.constant("zeros", np.zeros((6, 4), np.float32)),
                  b.op("Unsqueeze", row2slot, ints(b, [-1])), rows)
    weighted = b.op("Mul", b.op("Reshape", placed, ints(b, [3, 2, 4])), b.op("Unsqueeze", probs, ints(b, [-1])))
    b.output(b.op("ReduceSum", weighted, ints(b, [1]), keepdims=0), "y")
    original = b.build()
    fused, report = geir.fuse(original, allow_stricter_data=True)
    ops = [n.op_type for n in fused.nodes]
    assert ops[-1] == "MoeTokenUnpermute" and "ScatterND" not in ops and "ScatterElements" in ops
    assert report.fused[0].pattern.startswith("MoE unpermute")
    assert_same_function(original, fused)
    slots = np.array([2, 4, 0, 3, 1, 5])                      # row r goes to slot slots[r]
    feeds = {"rows": np.arange(24, dtype=np.float32).reshape(6, 4), "row2slot": slots,
             "probs": np.ones((3, 2), np.float32)}
    np.testing.assert_array_equal(geir.run(fused, feeds)["y"], geir.run(original, feeds)["y"])


def test_slot_major_rows_times_flattened_probs_are_an_unpermute_with_identity_indices():
    """transformers' batched experts (and DeepSeek-V3's, GPT-OSS's): expert outputs already in slot order, weighted by
    probs flattened to (T*K, 1) before the Reshape to (T, K, H): sorted_indices 0..T*K-1. The op skips zero
    weights, so with fed probs it fuses only under allow_stricter_data (a near miss saying why otherwise)."""
    b = geir.GraphBuilder("slot_major")
    rows = b.input("rows", "float32", (6, 4))
    probs = b.input("probs", "float32", (3, 2))
    weights = b.op("Unsqueeze", b.op("Reshape", probs, ints(b, [6], "flat")), ints(b, [-1], "last"))
    summed = b.op("Reshape", b.op("Mul", rows, weights), ints(b, [3, 2, 4], "tkh"))
    b.output(b.op("ReduceSum", summed, ints(b, [1], "k"), keepdims=0), "y")
    original = b.build()
    _, report = geir.fuse(original)
    assert "skips a slot of weight 0" in report.near_misses[0].reason
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert [n.op_type for n in fused.nodes] == ["MoeTokenUnpermute"], report
    assert np.array_equal(fused.constants[fused.nodes[0].inputs[1].name], np.arange(6, dtype=np.int32))
    assert_same_function(original, fused)


def _loop(experts: int = 3, tokens: int = 4, dtype: str = "float32", start: bool = True, fed: bool = False):
    """Mixtral's eager experts as TorchScript exports them: each expert's rows picked by NonZero (or fed with their
    token ids), its output scattered into zeros and added to a sum that starts from zeros."""
    b = geir.GraphBuilder("loop")
    x, ids = b.input("x", dtype, (tokens, 3)), b.input("ids", "int64", (tokens,))
    total = b.constant("start", np.zeros((tokens, 3), dtype)) if start else None
    for e in range(experts):
        if fed:
            picked = b.input(f"tok{e}", "int64", (f"n{e}",))
            out = b.input(f"rows{e}", dtype, (f"n{e}", 3))
        else:
            picked = b.op("Squeeze", b.op("NonZero", b.op("Equal", ids, ints(b, e, f"e{e}"))), ints(b, [0], f"row{e}"))
            rows = b.op("Gather", x, picked, axis=0)
            out = b.op("Mul", b.op("MatMul", rows, b.constant(f"w{e}", np.eye(3, dtype=dtype) * (e + 1))), rows)
        at = b.op("Expand", b.op("Unsqueeze", picked, ints(b, [1], f"col{e}")), b.op("Shape", out))
        back = b.op("ScatterElements", b.constant(f"zeros{e}", np.zeros((tokens, 3), dtype)), at, out, axis=0)
        total = back if total is None else b.op("Add", total, back)
    b.output(total, "y")
    return b.build()


def test_the_per_expert_loop_fuses_bit_for_bit_on_both_runtimes():
    """Slots per (token, iteration), probs of one: the op adds a token's rows in the loop's order, from +0."""
    original = _loop()
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert [f.became.split(" ")[0] for f in report.fused] == ["MoeTokenUnpermute"], report
    assert not any(n.op_type in ("ScatterElements", "Add") and not n.name.startswith("fused_") for n in fused.nodes)
    rng = np.random.default_rng(0)
    for ids in ([0, 1, 2, 0], [2, 2, 2, 2], [1, 0, 1, 0]):
        x = rng.standard_normal((4, 3)).astype(np.float32) * 1e3
        x[0, 0] = -0.0
        x[1, 1] = np.inf if ids[1] == 2 else np.nan
        feeds = {"x": x, "ids": np.array(ids, np.int64)}
        for runtime in RUNTIMES:
            want, got = geir.run(original, feeds, runtime=runtime)["y"], geir.run(fused, feeds, runtime=runtime)["y"]
            assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), (runtime, ids)


def test_loop_rows_sent_anywhere_are_refused_where_the_scatter_refuses_them():
    """Token ids fed as they are: negative ids count from the end as the scatter counts them, an id out of [-T, T)
    is refused by both graphs, and two rows of one iteration sent to one token are resolved as the scatter resolves
    them (the last row), or refused."""
    original = _loop(experts=2, fed=True)
    fused, _ = geir.fuse(original, allow_stricter_data=True)
    rng = np.random.default_rng(1)

    def feeds(tok0, tok1):
        return {"x": np.zeros((4, 3), np.float32), "ids": np.zeros(4, np.int64),
                "tok0": np.array(tok0, np.int64), "tok1": np.array(tok1, np.int64),
                "rows0": rng.standard_normal((len(tok0), 3)).astype(np.float32),
                "rows1": rng.standard_normal((len(tok1), 3)).astype(np.float32)}
    for runtime in RUNTIMES:
        given = feeds([0, -1, 2], [3, -4])
        want, got = geir.run(original, given, runtime=runtime)["y"], geir.run(fused, given, runtime=runtime)["y"]
        assert np.array_equal(want, got), runtime
        for bad in ([0, -5], [4], [-2**40]):
            with pytest.raises(geir.ExecutionError):
                geir.run(original, feeds(bad, [1]), runtime=runtime)
            with pytest.raises(geir.ExecutionError):
                geir.run(fused, feeds(bad, [1]), runtime=runtime)
        twice = feeds([1, 1], [1])
        try:
            got = geir.run(fused, twice, runtime=runtime)["y"]
        except geir.ExecutionError as exc:
            assert "MU-D1" in str(exc)
        else:
            assert np.array_equal(got, geir.run(original, twice, runtime=runtime)["y"]), runtime


@pytest.mark.parametrize("change, reason", [
    (dict(start=False), "does not start from +0 zeros"),
    (dict(dtype="float16"), "rounds after every add"),
])
def test_near_forms_of_the_loop_are_near_misses_not_skipped(change, reason):
    fused, report = geir.fuse(_loop(**change), allow_stricter_data=True)
    assert not report.fused
    assert [m.pattern.split(" (")[0] for m in report.near_misses] == ["MoE per-expert loop"], report
    assert reason in report.near_misses[0].reason


def test_the_loop_needs_allow_stricter_data():
    """Its sorted indices are computed, and the op checks them when the graph runs (MU-D1)."""
    _, report = geir.fuse(_loop())
    assert not report.fused and "allow_stricter_data" in report.near_misses[0].reason
