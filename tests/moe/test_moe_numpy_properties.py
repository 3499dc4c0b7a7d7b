"""Hypothesis: random tokens, topK, hidden sizes, permutations and dtypes against the float64 reference."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geir
from moe.helpers import bf16_tokens_f32_probs_expected, moe_grad_graph, moe_graph

pytestmark = bf16_tokens_f32_probs_expected      # every legal dtype pair, bfloat16/float32 included
from oracles.moe import unpermute_grad_reference, unpermute_reference
from oracles.numerics import assert_matches_reference

DTYPES = ("bfloat16", "float16", "float32")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 12), topk=st.integers(1, 6), hidden=st.integers(1, 24), extra_rows=st.integers(-3, 3),
       tt=st.sampled_from(DTYPES), tp=st.sampled_from(DTYPES), with_probs=st.booleans(), seed=st.integers(0, 2**16))
def test_random_cases_match_the_reference(tokens, topk, hidden, extra_rows, tt, tp, with_probs, seed):
    rng = np.random.default_rng(seed)
    topk = topk if with_probs else 1
    m = tokens * topk
    rows = max(0, m + extra_rows)
    np_tt, np_tp = geir.as_dtype(tt).numpy, geir.as_dtype(tp).numpy
    P = rng.standard_normal((rows, hidden)).astype(np_tt)
    s = rng.permutation(m).astype(np.int32)
    probs = rng.uniform(-1, 1, (tokens, topk)).astype(np_tp) if with_probs else None
    if probs is not None:
        probs[rng.uniform(size=probs.shape) < 0.2] = 0
    g = moe_graph(rows, hidden, m, None if probs is None else probs.shape, tt, tp)
    y = geir.run(g, {"tokens": P, "indices": s} | ({"probs": probs} if with_probs else {}))["y"]
    ref, mag = unpermute_reference(P, s, probs)
    rel = 2.0 ** -23 * (topk + 1)
    assert_matches_reference(y, ref, mag, "forward", compute_rel=rel, f32_rel=rel)

    P = rng.standard_normal((m, hidden)).astype(np_tt)
    dY = rng.standard_normal((tokens, hidden)).astype(np_tt)
    g = moe_grad_graph(P.shape if with_probs else None, dY.shape, m, None if probs is None else probs.shape, tt, tp)
    out = geir.run(g, {"dy": dY, "indices": s} | ({"tokens": P, "probs": probs} if with_probs else {}))
    ref_ptg, mag_ptg, ref_pg, mag_pg = unpermute_grad_reference(P, dY, s, probs)
    assert_matches_reference(out["ptg"], ref_ptg, mag_ptg, "ptg")
    rel = 2.0 ** -24 * (np.log2(hidden) + 2)
    assert_matches_reference(out["pg"], ref_pg, mag_pg, "pg", ulps=2, compute_rel=rel, f32_rel=rel)
