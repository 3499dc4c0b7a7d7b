"""geir.fuse on MoE unpermutes: a gather and a weighted sum (with probs unsqueezed or reshaped, or without), and rows
scattered to their slots, become MoeTokenUnpermute and compute what the original did."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from helpers import assert_same_function, ints
from moe.helpers import unpermute_subgraph


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


def test_a_per_expert_loop_is_a_near_miss_not_skipped():
    """Mixtral's eager experts: each expert's rows picked by NonZero, its output scattered back and added."""
    b = geir.GraphBuilder("loop")
    x, ids = b.input("x", "float32", (4, 3)), b.input("ids", "int64", (4,))
    total = None
    for e in range(2):
        tokens = b.op("Squeeze", b.op("NonZero", b.op("Equal", ids, ints(b, e, f"e{e}"))), ints(b, [0], f"row{e}"))
        out = b.op("MatMul", b.op("Gather", x, tokens, axis=0), b.constant(f"w{e}", np.eye(3, dtype=np.float32)))
        at = b.op("Expand", b.op("Unsqueeze", tokens, ints(b, [1], f"col{e}")), b.op("Shape", out))
        back = b.op("ScatterElements", b.constant(f"zeros{e}", np.zeros((4, 3), np.float32)), at, out, axis=0)
        total = back if total is None else b.op("Add", total, back)
    b.output(total, "y")
    fused, report = geir.fuse(b.build(), allow_stricter_data=True)
    assert not report.fused and [m.pattern.split(" (")[0] for m in report.near_misses] == ["MoE per-expert loop"] * 2
    assert "experts_implementation='batched_mm'" in report.near_misses[0].reason
