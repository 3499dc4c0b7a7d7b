"""MoE unpermute kernels through graphs: examples, dtypes, float64 reference, identities, data validation."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir import ExecutionError
from geir.runtimes.numpy import moe as kernels
from geir.runtimes.numpy.moe import moe_token_unpermute, moe_token_unpermute_grad
from geir.schemas.moe.examples import E2_DY, E2_FORWARD, E2_INDICES, E2_PG, E2_PROBS, E2_PTG, E2_ROWS
from moe.helpers import MOE, bf16_tokens_f32_probs_expected, moe_grad_graph, moe_graph

pytestmark = bf16_tokens_f32_probs_expected      # every legal dtype pair, bfloat16/float32 included
from oracles.moe import unpermute_grad_reference, unpermute_reference
from oracles.numerics import assert_matches_reference, bits_equal

DTYPES = ("bfloat16", "float16", "float32")
PAIRS = [(t, p) for t in DTYPES for p in DTYPES]


def _np(dtype):
    return geir.as_dtype(dtype).numpy


def _forward(P, s, probs=None):
    g = moe_graph(P.shape[0], P.shape[1], s.shape[0], None if probs is None else probs.shape, P.dtype,
                  None if probs is None else probs.dtype)
    feeds = {"tokens": P, "indices": s} | ({} if probs is None else {"probs": probs})
    return geir.run(g, feeds)["y"]


def _grad(P, dY, s, probs=None):
    g = moe_grad_graph(None if P is None else P.shape, dY.shape, s.shape[0], None if probs is None else probs.shape,
                       dY.dtype, None if probs is None else probs.dtype)
    feeds = {"dy": dY, "indices": s} | ({} if P is None else {"tokens": P}) | ({} if probs is None else {"probs": probs})
    out = geir.run(g, feeds)
    return out["ptg"], out["pg"]


def _case(tokens, topk, hidden, tt, tp, rows=None, seed=0, zero_probs=False):
    rng = np.random.default_rng(seed)
    m = tokens * topk
    P = rng.standard_normal((m if rows is None else rows, hidden)).astype(_np(tt))
    dY = rng.standard_normal((tokens, hidden)).astype(_np(tt))
    s = rng.permutation(m).astype(np.int32)
    probs = rng.uniform(0, 1, (tokens, topk)).astype(_np(tp))
    if zero_probs:
        probs[rng.uniform(size=probs.shape) < 0.3] = 0
    return P, dY, s, probs


# -- worked examples (spec 3.5) ---------------------------------------------------------------
def test_e1_cann_doc_grad_example():
    ptg, pg = _grad(np.ones((3, 2), np.float32), np.ones((1, 2), np.float32), np.array([0, 1, 2], np.int32),
                    np.ones((1, 3), np.float32))
    assert np.array_equal(ptg, np.ones((3, 2))) and np.array_equal(pg, [[2, 2, 2]])


@pytest.mark.parametrize("tt, tp", PAIRS)
def test_e2_exact_in_every_dtype(tt, tp):
    P, s = E2_ROWS.astype(_np(tt)), E2_INDICES
    probs, dY = E2_PROBS.astype(_np(tp)), E2_DY.astype(_np(tt))
    y = _forward(P, s, probs)
    assert y.dtype == _np(tt) and np.array_equal(y.astype(np.float64), E2_FORWARD)
    ptg, pg = _grad(P, dY, s, probs)
    assert ptg.dtype == _np(tt) and pg.dtype == _np(tp)
    assert np.array_equal(ptg.astype(np.float64), E2_PTG)
    assert np.array_equal(pg.astype(np.float64), E2_PG)
    # identity 6.4: all three inner products equal 55.5
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    assert np.vdot(f64(y), f64(dY)) == np.vdot(f64(P), f64(ptg)) == np.vdot(f64(probs), f64(pg)) == 55.5


def test_e3_mindspore_forward_without_probs():
    P = np.repeat(np.array([1, 0, 0, 3, 2, 1, 2, 3], np.float32)[:, None], 3, axis=1)
    y = _forward(P, np.array([0, 6, 7, 5, 3, 1, 2, 4], np.int32))
    assert np.array_equal(y, np.repeat(np.array([1, 2, 3, 1, 3, 0, 0, 2], np.float32)[:, None], 3, axis=1))


def test_e4_and_e5_structure_and_dropped_slots():
    P = np.array([[1, 2], [3, 4]], np.float32)
    assert np.array_equal(_forward(P, np.array([0, 1], np.int32), np.ones((1, 2), np.float32)), [[4, 6]])
    P = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    y = _forward(P, np.array([3, 0, 1, 2], np.int32), np.ones((2, 2), np.float32))  # slot 0 -> row 3 >= R: dropped
    assert np.array_equal(y, [[1, 2], [8, 10]])


def test_zero_weights_are_skipped_so_nan_rows_do_not_propagate():
    P = np.array([[np.nan, np.inf], [1, 2]], np.float32)
    y = _forward(P, np.array([0, 1], np.int32), np.array([[0, 3]], np.float32))
    assert np.array_equal(y, [[3, 6]])


# -- the spec's float32 sequence, bit for bit, on either path of the forward --------------------------
def _sequential_float32(P, s, probs):
    """Spec 3.3 in float32 as written: out starts at +0, each kept slot adds its rounded product, in k order."""
    tokens, topk = probs.shape
    out = np.zeros((tokens, P.shape[1]), np.float32)
    rows = s.reshape(tokens, topk)
    with np.errstate(all="ignore"):
        for k in range(topk):
            weight = probs[:, k].astype(np.float32)
            keep = (rows[:, k] < P.shape[0]) & (weight != 0)
            product = P[np.where(keep, rows[:, k], 0)].astype(np.float32) * weight[:, None]
            out = np.where(keep[:, None], out + product, out)
    return out


@pytest.mark.parametrize("einsum", [True, False], ids=["probed path", "two passes"])
@pytest.mark.parametrize("tt", DTYPES)
def test_forward_is_the_float32_sequence_bit_for_bit(tt, einsum, monkeypatch):
    """The forward's weighted sum runs as one einsum where this NumPy's einsum is the reference's sequence
    (einsum_adds_in_order), else as a multiply and a sum; either way the bits are the spec's float32 sequence."""
    if not einsum:
        monkeypatch.setattr(kernels, "einsum_adds_in_order", lambda tokens, compute: False)
    P, _, s, probs = _case(40, 6, 70, tt, "float32", rows=230, seed=11, zero_probs=True)  # 10 dropped slots
    P[3, 5], P[4, 1] = np.inf, -np.inf
    P[s[(probs.reshape(-1) == 0) & (s < P.shape[0])][0]] = np.nan     # a NaN row on a zero weight: skipped
    want = _sequential_float32(P, s, probs)
    got = moe_token_unpermute(P, s, probs)
    assert bits_equal(got, (want + 0.0).astype(P.dtype))


@pytest.mark.parametrize("tokens", DTYPES)
def test_the_einsum_probe_refuses_a_fused_or_reordered_sum(tokens, monkeypatch):
    probe = kernels.einsum_adds_in_order.__wrapped__        # uncached: each fake is probed afresh
    real = np.einsum

    def sequential(spec, w, x, dtype, casting):
        x = x.astype(dtype)
        total = w[:, 0, None] * x[:, 0]
        for k in range(1, w.shape[1]):
            total = total + w[:, k, None] * x[:, k]
        return total

    def fused(spec, w, x, dtype, casting):      # the products added without rounding them first, as FMA does
        return real(spec, w.astype(np.longdouble), x.astype(np.longdouble)).astype(dtype)

    def reversed_k(spec, w, x, dtype, casting):
        return sequential(spec, w[:, ::-1], x[:, ::-1], dtype, casting)

    for fake, expected in ((sequential, True), (fused, False), (reversed_k, False)):
        monkeypatch.setattr(np, "einsum", fake)
        assert probe(_np(tokens), np.dtype(np.float32)) is expected, fake.__name__


# -- float64 reference, all dtype pairs ---------------------------------------------------------
@pytest.mark.parametrize("tt, tp", PAIRS)
@pytest.mark.parametrize("topk", [1, 2, 5, 16])
def test_forward_matches_reference(tt, tp, topk):
    P, _, s, probs = _case(7, topk, 33, tt, tp, zero_probs=True, seed=topk)
    y = _forward(P, s, probs)
    ref, mag = unpermute_reference(P, s, probs)
    assert_matches_reference(y, ref, mag, f"forward {tt}/{tp} K={topk}", compute_rel=2.0 ** -23 * (topk + 1),
                             f32_rel=2.0 ** -23 * (topk + 1))


@pytest.mark.parametrize("tt", DTYPES)
def test_forward_without_probs_and_with_dropped_rows(tt):
    P, _, s, _ = _case(12, 1, 9, tt, tt, rows=8, seed=3)  # indices 8..11 are dropped slots
    y = _forward(P, s)
    ref, mag = unpermute_reference(P, s)
    assert_matches_reference(y, ref, mag, "no probs")
    kept = s < 8
    assert bits_equal(y[kept], P[s[kept]]) and not y[~kept].any()


@pytest.mark.parametrize("tt, tp", PAIRS)
@pytest.mark.parametrize("topk", [1, 3, 16])
def test_grad_matches_reference(tt, tp, topk):
    P, dY, s, probs = _case(9, topk, 40, tt, tp, seed=topk + 7)
    ptg, pg = _grad(P, dY, s, probs)
    ref_ptg, mag_ptg, ref_pg, mag_pg = unpermute_grad_reference(P, dY, s, probs)
    assert_matches_reference(ptg, ref_ptg, mag_ptg, f"ptg {tt}/{tp}")
    dot_rel = 2.0 ** -24 * (np.log2(40) + 2)
    assert_matches_reference(pg, ref_pg, mag_pg, f"pg {tt}/{tp}", ulps=2, compute_rel=dot_rel, f32_rel=dot_rel)


@pytest.mark.parametrize("tt", DTYPES)
def test_grad_without_probs_is_a_bit_copy_and_zero_probs_grad(tt):
    _, dY, s, _ = _case(11, 1, 7, tt, tt, seed=5)
    for tokens in (None, np.ones((11, 7), _np(tt))):
        ptg, pg = _grad(tokens, dY, s)
        assert bits_equal(ptg[s], dY)  # identity 6.4 convention check: ptg[s] == dY
        assert pg.shape == (11, 1) and pg.dtype == _np(tt) and not pg.any()


def test_probs_grad_ignores_the_probs_values():
    P, dY, s, probs = _case(5, 3, 8, "float32", "float32", seed=9)
    _, pg1 = _grad(P, dY, s, probs)
    _, pg2 = _grad(P, dY, s, probs * 7 + 1)
    assert np.array_equal(pg1, pg2)


# -- identities in float64 (spec 6.4) and the vector-Jacobian product -------------------------
@pytest.mark.parametrize("topk", [1, 2, 4])
def test_bilinearity_in_float64(topk):
    rng = np.random.default_rng(topk)
    tokens, hidden = 6, 5
    P = rng.standard_normal((tokens * topk, hidden))
    dY = rng.standard_normal((tokens, hidden))
    probs = rng.standard_normal((tokens, topk))
    s = rng.permutation(tokens * topk).astype(np.int32)
    y = moe_token_unpermute(P, s, probs)
    ptg, pg = moe_token_unpermute_grad(P, dY, s, probs)
    a, b, c = np.vdot(y, dY), np.vdot(P, ptg), np.vdot(probs, pg)
    assert abs(a - b) <= 1e-12 * abs(a) and abs(a - c) <= 1e-12 * abs(a)
    ptg0, _ = moe_token_unpermute_grad(None, dY[:, :], rng.permutation(tokens).astype(np.int32))
    assert ptg0.shape == (tokens, hidden)


def test_grad_is_the_vjp_of_the_forward_by_finite_differences():
    rng = np.random.default_rng(1)
    tokens, topk, hidden = 3, 2, 4
    P = rng.standard_normal((tokens * topk, hidden))
    probs = rng.uniform(0.1, 1, (tokens, topk))
    dY = rng.standard_normal((tokens, hidden))
    s = rng.permutation(tokens * topk).astype(np.int32)
    loss = lambda P_, pr_: np.vdot(moe_token_unpermute(P_, s, pr_), dY)  # noqa: E731
    ptg, pg = moe_token_unpermute_grad(P, dY, s, probs)
    h = 1e-6
    for index in np.ndindex(P.shape):
        e = np.zeros_like(P)
        e[index] = h
        assert abs((loss(P + e, probs) - loss(P - e, probs)) / (2 * h) - ptg[index]) < 1e-7
    for index in np.ndindex(probs.shape):
        e = np.zeros_like(probs)
        e[index] = h
        assert abs((loss(P, probs + e) - loss(P, probs - e)) / (2 * h) - pg[index]) < 1e-7


def test_blocking_and_threads_do_not_change_results(monkeypatch):
    P, dY, s, probs = _case(37, 3, 16, "bfloat16", "float32", seed=4, zero_probs=True)
    y, (ptg, pg) = moe_token_unpermute(P, s, probs), moe_token_unpermute_grad(P, dY, s, probs)
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 50)
    monkeypatch.setenv("GEIR_NUM_THREADS", "2")
    assert bits_equal(moe_token_unpermute(P, s, probs), y)
    ptg2, pg2 = moe_token_unpermute_grad(P, dY, s, probs)
    assert bits_equal(ptg2, ptg) and bits_equal(pg2, pg)


# -- CANN test shapes (spec 3.6) ----------------------------------------------------------------
@pytest.mark.parametrize("tt, tp, hidden", [("bfloat16", "bfloat16", 64), ("bfloat16", "float32", 64),
                                            ("float16", "float16", 64), ("bfloat16", "float32", 8192)])
def test_cann_grad_tiling_shapes(tt, tp, hidden):
    P, dY, s, probs = _case(10, 3, hidden, tt, tp, seed=hidden)
    ptg, pg = _grad(P, dY, s, probs)
    ref_ptg, mag_ptg, ref_pg, mag_pg = unpermute_grad_reference(P, dY, s, probs)
    assert_matches_reference(ptg, ref_ptg, mag_ptg, "ptg")
    rel = 2.0 ** -24 * (np.log2(hidden) + 2)
    assert_matches_reference(pg, ref_pg, mag_pg, "pg", ulps=2, compute_rel=rel, f32_rel=rel)


@pytest.mark.slow
def test_cann_grad_st_shape():
    """bf16 (9638, 5376) tokens and grad, indices (9638,), probs (9638, 1)."""
    P, dY, s, probs = _case(9638, 1, 5376, "bfloat16", "bfloat16", seed=11)
    ptg, pg = _grad(P, dY, s, probs)
    ref_ptg = dY.astype(np.float32) * probs.astype(np.float32)
    assert bits_equal(ptg[s], ref_ptg.astype(dY.dtype))
    terms = P[s].astype(np.float64) * dY.astype(np.float64)
    rel = 2.0 ** -24 * (np.log2(5376) + 2)
    assert_matches_reference(pg, terms.sum(-1, keepdims=True), np.abs(terms).sum(-1, keepdims=True), "pg",
                             ulps=2, compute_rel=rel)


# -- run-time data validation (spec 3.4) ---------------------------------------------------------
@pytest.mark.parametrize("indices, fact", [
    ([0, 1, 4, 2], "input 1 'sorted_indices' position 2: expected a value in [0, 4) (a permutation of 0..3), got 4"),
    ([0, -1, 2, 3], "position 1: expected a value in [0, 4) (a permutation of 0..3), got -1"),
    ([3, 1, 3, 1], "positions 0 and 2: expected distinct values (a permutation of 0..3), got 3 twice"),
    ([2, 0, 0, 2], "positions 1 and 2: expected distinct values (a permutation of 0..3), got 0 twice"),
])
def test_forward_rejects_bad_indices(indices, fact):
    with pytest.raises(ExecutionError) as err:
        _forward(np.ones((4, 2), np.float32), np.array(indices, np.int32), np.ones((2, 2), np.float32))
    assert str(err.value).startswith(f"[MU-D1] {MOE} 'node': ") and fact in str(err.value)
    assert err.value.rule == "MU-D1" and err.value.node == "node"


def test_grad_rejects_bad_indices_with_and_without_probs():
    with pytest.raises(ExecutionError, match=r"\[MG-D1\] MoeTokenUnpermuteGrad 'node': input 2 'sorted_indices' position 0: "
                                             r"expected a value in \[0, 3\)"):
        _grad(None, np.ones((3, 2), np.float32), np.array([7, 1, 2], np.int32))
    with pytest.raises(ExecutionError, match=r"\[MG-D1\] .*positions 0 and 1: .*got 0 twice"):
        _grad(np.ones((4, 2), np.float32), np.ones((2, 2), np.float32), np.array([0, 0, 1, 2], np.int32),
              np.ones((2, 2), np.float32))


def test_dropped_slot_values_are_valid_only_below_len_indices():
    # R = 2 rows, M = 4 slots: values 2 and 3 are dropped slots (valid); 4 is out of range
    y = _forward(np.ones((2, 2), np.float32), np.array([2, 0, 3, 1], np.int32), np.ones((2, 2), np.float32))
    assert np.array_equal(y, [[1, 1], [1, 1]])
    with pytest.raises(ExecutionError, match="got 4"):
        _forward(np.ones((2, 2), np.float32), np.array([4, 0, 3, 1], np.int32), np.ones((2, 2), np.float32))


def test_feeds_are_never_modified():
    P, dY, s, probs = _case(4, 2, 6, "bfloat16", "float16", seed=2)
    before = [a.copy() for a in (P, dY, s, probs)]
    _grad(P, dY, s, probs)
    _forward(P, s, probs)
    assert all(bits_equal(a, b) for a, b in zip((P, dY, s, probs), before))
