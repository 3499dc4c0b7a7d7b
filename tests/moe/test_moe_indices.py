"""Index-convention helpers against the spec's worked examples (spec 3.3, 3.5)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import geir
from geir import moe_indices as mi


def test_spec_routing_example():
    e = np.array([[1, 2], [0, 1], [0, 2], [1, 2]])
    s = mi.sorted_indices_from_expert_ids(e)
    assert s.dtype == np.int32 and s.tolist() == [2, 5, 0, 3, 1, 6, 4, 7]
    assert mi.to_row_to_slot(s).tolist() == [2, 4, 0, 3, 6, 1, 5, 7]
    assert mi.to_transformer_engine(s, 2).tolist() == [2, 0, 1, 4, 5, 3, 6, 7]
    assert mi.from_transformer_engine([2, 0, 1, 4, 5, 3, 6, 7], 2).tolist() == s.tolist()
    assert mi.from_row_to_slot([2, 4, 0, 3, 6, 1, 5, 7]).tolist() == s.tolist()
    megatron = np.array([2, 4, 0, 3, 6, 1, 5, 7]) // 2
    assert mi.from_megatron(megatron, e).tolist() == s.tolist()


def test_e2_conventions():
    s = np.array([2, 0, 3, 1])
    assert mi.to_row_to_slot(s).tolist() == [1, 3, 0, 2]
    assert (mi.to_row_to_slot(s) // 2).tolist() == [0, 1, 0, 1]  # Megatron
    assert mi.to_transformer_engine(s, 2).tolist() == [2, 3, 0, 1]


def test_converted_indices_drive_the_op_like_the_original_routing():
    """Unpermuting with converted indices restores each token's own rows."""
    rng = np.random.default_rng(0)
    tokens, topk, hidden = 5, 3, 4
    e = np.stack([rng.choice(8, topk, replace=False) for _ in range(tokens)])
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    row2slot = np.argsort(e.reshape(-1), kind="stable")
    permuted = np.repeat(x, topk, axis=0)[row2slot]  # each row is its token's copy, sorted by expert
    b = geir.GraphBuilder("restore")
    p = b.input("p", "float32", permuted.shape)
    s = b.input("s", "int32", (tokens * topk,))
    pr = b.input("pr", "float32", (tokens, topk))
    b.output(b.MoeTokenUnpermute(p, s, pr), "y")
    graph = b.build()
    weights = np.full((tokens, topk), 1 / topk, np.float32)
    te = mi.to_transformer_engine(mi.from_row_to_slot(row2slot), topk)
    for indices in (mi.sorted_indices_from_expert_ids(e), mi.from_transformer_engine(te, topk),
                    mi.from_megatron(row2slot // topk, e)):
        y = geir.run(graph, {"p": permuted, "s": indices, "pr": weights})["y"]
        np.testing.assert_allclose(y, x, rtol=1e-6)


def test_inconsistent_inputs_are_rejected():
    with pytest.raises(ValueError, match="row2slot must be a permutation of 0..3"):
        mi.from_row_to_slot([0, 1, 1, 2])
    with pytest.raises(ValueError, match="not divisible by topK = 3"):
        mi.from_transformer_engine([0, 1, 2, 3], 3)
    with pytest.raises(ValueError, match="does not match a stable sort of expert_ids"):
        mi.from_megatron([0, 0, 1, 1], np.array([[1, 0], [0, 1]]))
    with pytest.raises(ValueError, match=r"expert_ids must be \(tokens, topK\)"):
        mi.sorted_indices_from_expert_ids(np.arange(4))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 1000))
def test_conversions_round_trip(tokens, topk, seed):
    s = np.random.default_rng(seed).permutation(tokens * topk)
    assert mi.from_row_to_slot(mi.to_row_to_slot(s)).tolist() == s.tolist()
    assert mi.from_transformer_engine(mi.to_transformer_engine(s, topk), topk).tolist() == s.tolist()
