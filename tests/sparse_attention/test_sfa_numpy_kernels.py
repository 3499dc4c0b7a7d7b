"""Sparse flash attention: examples, the spec's reference, VJP, dense oracle, identities, data validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import geir
from geir import ExecutionError
from geir.runtimes.numpy import sparse_attention as kernels
from geir.runtimes.numpy.sparse_attention import sparse_flash_attention, sparse_flash_attention_grad
from geir.schemas.sparse_attention.selection import candidates, query_rows
from helpers import NP
from oracles.numerics import assert_within_ulps_of_scale
from oracles.sfa import batches, forward_reference, grad_reference, select
from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase, sfa_graph

GRAD_NAMES = ("d_query", "d_key", "d_value", "d_query_rope", "d_key_rope")


def run_forward_kernel(c: AttentionCase, a: dict, value=None):
    v = a["value"] if value is None else value
    return sparse_flash_attention(a["query"], a["key"], v, a["sparse_indices"], None, a["actual_seq_lengths_query"],
                                  a["actual_seq_lengths_kv"], a["query_rope"], a["key_rope"], a["sinks"],
                                  **c.forward_attrs())


_FROM_CASE = object()


def run_grad_kernel(c: AttentionCase, a: dict, d_out, out, mx, sm, value=_FROM_CASE):
    tnd = c.layout == "TND"
    return sparse_flash_attention_grad(
        a["query"], a["key"], a["sparse_indices"], d_out, out, mx, sm, a["value"] if value is _FROM_CASE else value,
        a["actual_seq_lengths_query"] if tnd else None, a["actual_seq_lengths_kv"] if tnd else None,
        a["query_rope"], a["key_rope"], **c.grad_attrs())


def reference_forward(c: AttentionCase, a: dict, value=None, round_to=None):
    return forward_reference(a["query"], a["key"], a["value"] if value is None else value, a["sparse_indices"],
                             scale=c.scale, bs=c.bs, layout=c.layout, mode=c.mode, aq=a["actual_seq_lengths_query"],
                             akv=a["actual_seq_lengths_kv"], query_rope=a["query_rope"], key_rope=a["key_rope"],
                             sinks=a["sinks"], round_to=round_to)


def reference_grad(c: AttentionCase, a: dict, d_out, out, mx, sm, round_to=None):
    tnd = c.layout == "TND"
    return grad_reference(a["query"], a["key"], a["sparse_indices"], d_out, out, mx, sm, scale=c.scale,
                          value=a["value"], bs=c.bs, layout=c.layout, mode=c.mode,
                          aq=a["actual_seq_lengths_query"] if tnd else None,
                          akv=a["actual_seq_lengths_kv"] if tnd else None, query_rope=a["query_rope"],
                          key_rope=a["key_rope"], round_to=round_to)


def fwd_grad_graph(c: AttentionCase, a: dict):
    """Forward and grad in one graph: the forward's outputs feed the grad (the demo's shape too)."""
    b = geir.GraphBuilder("sfa_train")
    inputs = {k: b.input(k, v.dtype, v.shape) for k, v in a.items() if v is not None}
    d_out = b.input("d_out", a["query"].dtype, a["query"].shape[:-1] + (
        (a["value"] if a["value"] is not None else a["key"][..., :c.D2]).shape[-1],))
    fwd_inputs = dict(inputs)
    if a["value"] is None:
        raise ValueError("the forward needs a value")
    out, mx, sm = b.SparseFlashAttention(**fwd_inputs, **c.forward_attrs())
    lengths = {k: inputs[k] for k in ("actual_seq_lengths_query", "actual_seq_lengths_kv") if k in inputs} \
        if c.layout == "TND" else {}
    grads = b.SparseFlashAttentionGrad(inputs["query"], inputs["key"], inputs["sparse_indices"], d_out, out, mx, sm,
                                       inputs["value"], query_rope=inputs.get("query_rope"),
                                       key_rope=inputs.get("key_rope"), **lengths, **c.grad_attrs())
    for name, value in zip(("attention_out", "softmax_max", "softmax_sum"), (out, mx, sm)):
        b.output(value, name)
    for name, value in zip(GRAD_NAMES, grads):
        if value is not None:
            b.output(value, name)
    return b.build()


# -- worked examples (spec 4.9) -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_e1_forward_and_grad_in_one_graph(dtype):
    dt = NP[dtype]
    a = {"query": np.ones((1, 1, 2, 4), dt),
         "key": np.array([[1] * 4, [2] * 4, [2, 0, 1, 1], [4] * 4], dt).reshape(1, 4, 1, 4),
         "value": np.repeat(np.arange(1, 5), 4).reshape(1, 4, 1, 4).astype(dt),
         "sparse_indices": np.array([0, 2, -1, -1], np.int32).reshape(1, 1, 1, 4),
         "actual_seq_lengths_query": None, "actual_seq_lengths_kv": None, "query_rope": None, "key_rope": None,
         "sinks": None}
    c = AttentionCase(D=4, D2=4, N1=2, mode=0, scale_value=0.5)
    g = fwd_grad_graph(c, a)
    feeds = {k: v for k, v in a.items() if v is not None} | {"d_out": np.ones((1, 1, 2, 4), dt)}
    r = geir.run(g, feeds)
    assert np.array_equal(r["attention_out"].astype(np.float64), np.full((1, 1, 2, 4), 2.0))
    assert np.array_equal(r["softmax_max"], np.full((1, 1, 1, 2), 2.0, np.float32))
    assert np.array_equal(r["softmax_sum"], np.full((1, 1, 1, 2), 2.0, np.float32))
    assert np.array_equal(r["d_query"].astype(np.float64), np.tile([1.0, -1, 0, 0], (1, 1, 2, 1)))
    assert np.array_equal(r["d_key"].astype(np.float64).reshape(4, 4), [[-2] * 4, [0] * 4, [2] * 4, [0] * 4])
    assert np.array_equal(r["d_value"].astype(np.float64).reshape(4, 4), [[1] * 4, [0] * 4, [1] * 4, [0] * 4])


def test_e2_selection_mode3_block2():
    entries = np.array([[0, -1], [0, -1], [0, 1], [1, 0]], np.int32)[:, None, :]
    rows = query_rows("BSND", 4, 4, 4, None, None, 3)
    assert rows.threshold.tolist() == [1, 2, 3, 4]
    pos, valid = candidates(entries, rows.threshold, 2, max_keys=4)
    got = [sorted(pos[r, 0][valid[r, 0]].tolist()) for r in range(4)]
    assert got == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert [select(entries[r, 0], t, 2) for r, t in enumerate([1, 2, 3, 4])] == [[0], [0, 1], [0, 1, 2], [2, 3, 0, 1]]
    future_first = np.array([[[1, 0]]], np.int32)    # s1 = 0 reads only block 1 (future): empty
    pos, valid = candidates(future_first, np.array([1]), 2, max_keys=4)
    assert not valid.any() and select([1, 0], 1, 2) == []


def test_e3_tnd_visibility():
    aq, akv = np.array([2, 5]), np.array([3, 7])
    rows = query_rows("TND", 6, 0, 0, aq, akv, 3)
    entries = np.tile(np.arange(4, dtype=np.int32), (6, 1, 1))
    pos, valid = candidates(entries, rows.threshold, 1, max_keys=7)
    visible = [sorted((rows.kv_start[t] + pos[t, 0][valid[t, 0]]).tolist()) if rows.active[t] else None
               for t in range(6)]
    assert visible == [[0, 1], [0, 1, 2], [3, 4], [3, 4, 5], [3, 4, 5, 6], None]  # row 5 belongs to no batch


# -- the spec's reference, float64 (no rounding): every structural option --------------------------
GRID = list(itertools.product((0, 4), (False, True), (1, 2), (False, True), (False, True)))


@pytest.mark.parametrize("layout, mode, bs", list(itertools.product(("BSND", "TND"), (0, 3), (1, 2, 4))))
def test_float64_kernels_match_the_reference(layout, mode, bs):
    for dr, merge, n2, sinks, lengths in GRID:
        c = AttentionCase(layout=layout, mode=mode, bs=bs, Dr=dr, kv_merge=merge, N2=n2, sinks=sinks, lengths=lengths,
                          N1=4, D2=6, dtype="float64", seed=bs + n2 + dr)
        a = c.arrays()
        value = a["value"] if a["value"] is not None else a["key"][..., :c.D2].copy()
        out, mx, sm = run_forward_kernel(c, a, value)
        for got, want in zip((out, mx, sm), reference_forward(c, a, value)):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        # the grad ignores BSND lengths: feed it stats that cover every row
        if layout == "BSND" and lengths:
            a = dict(a, actual_seq_lengths_query=None, actual_seq_lengths_kv=None)
            out, mx, sm = run_forward_kernel(c, a, value)
        d_out = np.random.default_rng(c.seed).standard_normal(out.shape)
        for got, want in zip(run_grad_kernel(c, a, d_out, out, mx, sm), reference_grad(c, a, d_out, out, mx, sm)):
            assert (got is None) == (want is None)
            if got is not None:
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# -- float16 / bfloat16 graphs against the reference with the same roundings -------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout, mode, bs, dr, n2, sinks", [
    ("BSND", 3, 1, 0, 1, False), ("BSND", 0, 2, 4, 2, True), ("TND", 3, 4, 4, 1, False), ("TND", 0, 1, 0, 2, True),
    ("BSND", 3, 4, 4, 1, True), ("TND", 3, 2, 0, 1, False)])
def test_half_precision_graphs_match_the_rounding_reference(dtype, layout, mode, bs, dr, n2, sinks):
    c = AttentionCase(layout=layout, mode=mode, bs=bs, Dr=dr, N2=n2, N1=4, sinks=sinks, dtype=dtype, S1=6, S2=11,
                      D=16, D2=12, K=5, seed=7, tnd_q=[4, 9], tnd_kv=[5, 13])
    a = c.arrays()
    g = fwd_grad_graph(c, a)
    d_out = np.random.default_rng(3).standard_normal(a["query"].shape[:-1] + (c.D2,)).astype(NP[dtype])
    feeds = {k: v for k, v in a.items() if v is not None} | {"d_out": d_out}
    before = {k: v.copy() for k, v in feeds.items()}
    r = geir.run(g, feeds)
    assert all(np.array_equal(before[k].view(np.uint8), feeds[k].view(np.uint8)) for k in feeds)
    dt = NP[dtype]
    ref_out, ref_mx, ref_sm = reference_forward(c, a, round_to=dt)
    assert_within_ulps_of_scale(r["attention_out"], ref_out, dt, what="attention_out")
    np.testing.assert_allclose(r["softmax_max"], ref_mx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["softmax_sum"], ref_sm, rtol=1e-5, atol=1e-6)
    refs = reference_grad(c, a, d_out, r["attention_out"], r["softmax_max"], r["softmax_sum"], round_to=dt)
    for name, want in zip(GRAD_NAMES, refs):
        if want is None:
            assert name not in r
        else:
            assert r[name].dtype == dt
            assert_within_ulps_of_scale(r[name], want, dt, what=name)


# -- identity 5: the grad is the VJP of the forward (finite differences, float64 kernels) ------------
@pytest.mark.parametrize("layout, mode, bs, dr, merge, n2, sinks", [
    ("BSND", 3, 1, 0, False, 1, False), ("BSND", 0, 2, 3, False, 2, True), ("TND", 3, 1, 3, True, 1, False),
    ("TND", 0, 3, 0, False, 2, False), ("BSND", 3, 2, 3, True, 2, True)])
def test_grad_is_the_vjp_of_the_forward(layout, mode, bs, dr, merge, n2, sinks):
    c = AttentionCase(layout=layout, mode=mode, bs=bs, Dr=dr, kv_merge=merge, N2=n2, N1=2 * n2, sinks=sinks,
                      dtype="float64", B=1, S1=3, S2=5, D=3, D2=2, K=3, seed=5, tnd_q=[2, 4], tnd_kv=[3, 6])
    a = c.arrays()
    d_out = np.random.default_rng(9).standard_normal(a["query"].shape[:-1] + (c.D2,))
    names = ["query", "key"] + (["value"] if not merge else []) + (["query_rope", "key_rope"] if dr else [])

    def loss(arrays):
        value = arrays["value"] if not merge else arrays["key"][..., :c.D2]
        return np.vdot(run_forward_kernel(c, arrays, value)[0], d_out)

    value = a["value"] if not merge else a["key"][..., :c.D2]
    out, mx, sm = run_forward_kernel(c, a, value)
    grads = dict(zip(GRAD_NAMES, run_grad_kernel(c, a, d_out, out, mx, sm)))
    h = 1e-6
    for name in names:
        grad = grads["d_" + name]
        for index in np.ndindex(a[name].shape):
            plus, minus = dict(a), dict(a)
            plus[name], minus[name] = a[name].copy(), a[name].copy()
            plus[name][index] += h
            minus[name][index] -= h
            fd = (loss(plus) - loss(minus)) / (2 * h)
            assert abs(fd - grad[index]) < 1e-6 * max(1.0, abs(fd)), (name, index, fd, grad[index])


# -- identity 6 and 8: dense masked attention in float64 ---------------------------------------------
def dense_oracle(c: AttentionCase, a: dict):
    """Dense masked attention and its backward, float64, one batch/head at a time via full matrices."""
    q64 = lambda x: None if x is None else x.astype(np.float64)  # noqa: E731
    query, key, value = q64(a["query"]), q64(a["key"]), q64(a["value"])
    if a["query_rope"] is not None:
        query = np.concatenate([query, q64(a["query_rope"])], -1)
        key = np.concatenate([key, q64(a["key_rope"])], -1)
    n1, n2 = query.shape[-2], key.shape[-2]
    g = n1 // n2
    out = np.zeros(a["query"].shape[:-1] + (value.shape[-1],))
    lse = {}
    for _, s1b, s2b, qrow, kvrow, _ in batches(c.layout, a["query"].shape, a["key"].shape,
                                               a["actual_seq_lengths_query"], a["actual_seq_lengths_kv"], True):
        if s1b == 0 or s2b == 0:
            continue
        kv_rows = [kvrow(j) for j in range(s2b)]
        for h in range(n1):
            hk = h // g
            Q = np.stack([query[qrow(s1) + (h,)] for s1 in range(s1b)])
            Kd = np.stack([key[r + (hk,)] for r in kv_rows])
            V = np.stack([value[r + (hk,)] for r in kv_rows])
            mask = np.zeros((s1b, s2b), bool)
            for s1 in range(s1b):
                thr = s2b if c.mode == 0 else s2b - s1b + s1 + 1
                mask[s1, select(a["sparse_indices"][qrow(s1) + (hk,)], thr, c.bs)] = True
            scores = np.where(mask, c.scale * Q @ Kd.T, -np.inf)
            m = np.max(scores, axis=-1, keepdims=True)
            with np.errstate(invalid="ignore"):
                P = np.where(mask, np.exp(scores - np.where(np.isfinite(m), m, 0)), 0)
            total = P.sum(-1, keepdims=True)
            P = np.divide(P, total, out=np.zeros_like(P), where=total > 0)
            o = P @ V
            for s1 in range(s1b):
                out[qrow(s1) + (h,)] = o[s1]
                if mask[s1].any():
                    lse[qrow(s1) + (h,)] = float(m[s1, 0] + np.log(total[s1, 0]))
    return out, lse


@pytest.mark.parametrize("dtype, limit", [("float16", 5e-3), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("layout, mode, bs", [("BSND", 3, 1), ("BSND", 0, 4), ("TND", 3, 2), ("TND", 0, 1)])
def test_dense_oracle_and_log_sum_exp(dtype, limit, layout, mode, bs):
    c = AttentionCase(layout=layout, mode=mode, bs=bs, Dr=8, N1=4, N2=2, dtype=dtype, S1=7, S2=12, D=16, D2=16, K=6,
                      seed=11, tnd_q=[3, 8], tnd_kv=[6, 14])
    a = c.arrays()
    out, mx, sm = run_forward_kernel(c, a)
    dense_out, lse = dense_oracle(c, a)
    err = np.linalg.norm(out.astype(np.float64) - dense_out) / np.linalg.norm(dense_out)
    assert err <= limit, err
    g = c.N1 // c.N2
    for index, value in lse.items():           # identity 8: max + log(sum) is the log-sum-exp
        h = index[-1]
        stats_index = ((index[0], h // g, index[1], h % g) if layout == "BSND" else (h // g, index[0], h % g))
        assert abs(mx[stats_index] + np.log(sm[stats_index]) - value) < 1e-4 * max(1, abs(value))


# -- identity 7: structure ----------------------------------------------------------------------------
def test_n2_heads_are_independent_problems():
    c = AttentionCase(N1=6, N2=3, Dr=4, dtype="float64", seed=2)
    a = c.arrays()
    out, mx, sm = run_forward_kernel(c, a)
    for h2 in range(3):
        part = {k: v for k, v in a.items()}
        for name in ("key", "value", "key_rope", "sparse_indices"):
            part[name] = a[name][:, :, h2:h2 + 1]
        for name in ("query", "query_rope"):
            part[name] = a[name][:, :, 2 * h2:2 * h2 + 2]
        sub = AttentionCase(N1=2, N2=1, Dr=4, dtype="float64")
        o, m, s = run_forward_kernel(sub, part)
        np.testing.assert_allclose(out[:, :, 2 * h2:2 * h2 + 2], o, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(mx[:, h2:h2 + 1], m, rtol=1e-13)


def test_permuting_valid_entries_changes_nothing_beyond_rounding():
    c = AttentionCase(mode=0, K=6, S2=20, dtype="float16", seed=4)
    a = c.arrays()
    out, mx, sm = run_forward_kernel(c, a)
    rng = np.random.default_rng(0)
    shuffled = a["sparse_indices"].copy()
    for idx in np.ndindex(shuffled.shape[:-1]):
        row = shuffled[idx]
        n = int(np.sum(row != -1))
        row[:n] = rng.permutation(row[:n])
    out2, mx2, sm2 = run_forward_kernel(c, dict(a, sparse_indices=shuffled))
    np.testing.assert_allclose(out2.astype(np.float32), out.astype(np.float32), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(sm2, sm, rtol=1e-6)


def test_block_size_equals_expanded_positions():
    c = AttentionCase(mode=3, bs=3, K=3, S1=4, S2=10, dtype="float64", seed=6)
    a = c.arrays()
    expanded = np.full(a["sparse_indices"].shape[:-1] + (c.K * c.bs,), -1, np.int32)
    for _, s1b, s2b, qrow, _, _ in batches("BSND", a["query"].shape, a["key"].shape, None, None, True):
        for s1 in range(s1b):
            thr = s2b - s1b + s1 + 1
            pos = select(a["sparse_indices"][qrow(s1) + (0,)], thr, c.bs)
            expanded[qrow(s1) + (0, slice(0, len(pos)))] = pos
    fine = AttentionCase(mode=3, bs=1, K=9, S1=4, S2=10, dtype="float64")
    for got, want in zip(run_forward_kernel(c, a), run_forward_kernel(fine, dict(a, sparse_indices=expanded))):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_kv_merge_equals_value_from_key():
    c = AttentionCase(kv_merge=True, D=8, D2=5, Dr=3, dtype="float64", seed=8)
    a = c.arrays()
    value = a["key"][..., :5].copy()
    out, mx, sm = run_forward_kernel(c, a, value)
    d_out = np.random.default_rng(1).standard_normal(out.shape)
    merged = run_grad_kernel(c, a, d_out, out, mx, sm)
    separate = run_grad_kernel(c, a, d_out, out, mx, sm, value=value)
    expected_dk = separate[1].copy()
    expected_dk[..., :5] += separate[2]
    assert merged[2] is None
    np.testing.assert_allclose(merged[1], expected_dk, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(merged[0], separate[0], rtol=1e-13, atol=1e-13)


def test_rows_without_keys_give_zeros_and_sinks_stats():
    c = AttentionCase(mode=0, sinks=True, K=3, dtype="float64", seed=1)
    a = c.arrays()
    a["sparse_indices"][0, 1] = -1                  # (b=0, s1=1): no key selected
    out, mx, sm = run_forward_kernel(c, a)
    assert not out[0, 1].any()
    np.testing.assert_array_equal(mx[0, 0, 1], a["sinks"])
    np.testing.assert_array_equal(sm[0, 0, 1], 1.0)
    d_out = np.ones_like(out)
    dq = run_grad_kernel(c, a, d_out, out, mx, sm)[0]
    assert not dq[0, 1].any()
    c3 = AttentionCase(mode=3, sinks=True, lengths=True, S1=5, S2=2, dtype="float64", seed=2)  # thr <= 0 rows: all zero
    a3 = c3.arrays()
    a3["actual_seq_lengths_query"][:] = 5
    a3["actual_seq_lengths_kv"][:] = 2
    out, mx, sm = run_forward_kernel(c3, a3)
    assert not out[:, :2].any() and not mx[:, :, :2].any() and not sm[:, :, :2].any()


def test_blocks_and_threads_do_not_change_results(monkeypatch):
    c = AttentionCase(layout="TND", mode=3, bs=2, Dr=4, N2=2, N1=4, dtype="bfloat16", seed=3, tnd_q=[5, 11],
                      tnd_kv=[7, 16])
    a = c.arrays()
    out, mx, sm = run_forward_kernel(c, a)
    d_out = np.ones_like(out)
    grads = run_grad_kernel(c, a, d_out, out, mx, sm)
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 1)
    monkeypatch.setenv("GEIR_NUM_THREADS", "2")
    out2, _, _ = run_forward_kernel(c, a)
    assert np.array_equal(out2.view(np.uint16), out.view(np.uint16))
    for x, y in zip(run_grad_kernel(c, a, d_out, out, mx, sm), grads):
        if x is not None:   # summation order of dK/dV may differ: float32 rounding only
            np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_grad_adds_thread_partials_in_chunk_order_not_finishing_order(monkeypatch):
    """Each thread sums its chunk of blocks into a partial [dK | dV]; the partials must be added in chunk
    order, whichever thread finishes first (with three or more, sums differ by order). float64 (the test
    hook) so that no final rounding to a 16-bit type hides a difference in the last bits."""
    c = AttentionCase(mode=0, K=16, S1=24, S2=64, N1=8, D=32, D2=32, dtype="float64", seed=5)
    a = c.arrays()
    out, mx, sm = run_forward_kernel(c, a)
    d_out = np.random.default_rng(1).standard_normal(out.shape)
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 1)          # one query row per block

    def chunked(reverse: bool):
        def parallel_for(work, items):
            chunks = [list(items[i::4]) for i in range(4)]     # four interleaved "threads"
            chunks = [sorted(ch, key=lambda qi: int(qi[0])) for ch in chunks]
            for ch in reversed(chunks) if reverse else chunks:
                work(ch)
        return parallel_for

    monkeypatch.setattr(kernels, "parallel_for", chunked(False))
    in_order = run_grad_kernel(c, a, d_out, out, mx, sm)
    monkeypatch.setattr(kernels, "parallel_for", chunked(True))
    finished_backwards = run_grad_kernel(c, a, d_out, out, mx, sm)
    for x, y in zip(in_order, finished_backwards):
        if x is not None:
            assert np.array_equal(x.view(np.uint64), y.view(np.uint64))


def test_conflict_free_rounds_cover_every_entry_once_without_repeated_targets():
    targets = np.array([5, 1, 5, 5, 2, 1, 7, 5])
    rounds = kernels._conflict_free_rounds(targets)
    assert [r.tolist() for r in rounds] == [[0, 1, 4, 6], [2, 5], [3], [7]]   # i-th entry of a target: round i
    assert kernels._conflict_free_rounds(np.array([], np.intp)) == []


def test_scatter_add_sums_repeated_rows_in_entry_order():
    """Bit-identical to a sequential loop in float32 (so the order is the entries' order)."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 6, 200)
    values = (rng.standard_normal((300, 5)) * 10.0 ** rng.integers(-4, 5, (300, 1))).astype(np.float32)
    picks = rng.permutation(300)[:200]
    got = np.zeros((6, 5), np.float32)
    kernels._scatter_add(got, rows, values, picks)
    expected = np.zeros((6, 5), np.float32)
    for r, pick in zip(rows, picks):
        expected[r] += values[pick]
    assert np.array_equal(got, expected)


# -- run-time data validation (spec 4.8) ----------------------------------------------------------
def _validate(feeds, op=SFA, **attrs):
    attrs.setdefault("scale_value", 0.5)
    g, feeds = sfa_graph(feeds, op, **attrs)
    return geir.run(g, feeds)


def _tnd_feeds(aq, akv, indices=None):
    c = AttentionCase(layout="TND", K=3, tnd_q=[2, 5], tnd_kv=[4, 9])
    a = c.arrays()
    a["actual_seq_lengths_query"] = np.array(aq, np.int32)
    a["actual_seq_lengths_kv"] = np.array(akv, np.int32)
    if indices is not None:
        a["sparse_indices"] = indices
    return a, dict(layout_query="TND", layout_kv="TND", sparse_mode=0)


@pytest.mark.parametrize("aq, akv, fact", [
    ([-1, 5], [4, 9], "input 5 'actual_seq_lengths_query' position 0: expected a first cumulative length >= 0, got -1"),
    ([3, 2], [4, 9], "input 5 'actual_seq_lengths_query' position 1: expected a non-decreasing value (>= 3), got 2"),
    ([2, 7], [4, 9], "input 5 'actual_seq_lengths_query' position 1: expected a last value <= 6 (T1), got 7"),
    ([2, 5], [4, 12], "input 6 'actual_seq_lengths_kv' position 1: expected a last value <= 11 (T2), got 12"),
])
def test_tnd_lengths(aq, akv, fact):
    a, attrs = _tnd_feeds(aq, akv)
    with pytest.raises(ExecutionError) as err:
        _validate(a, **attrs)
    assert str(err.value).startswith("[SA-D1] SparseFlashAttention 'node': ") and fact in str(err.value)


def test_bsnd_forward_lengths():
    c = AttentionCase(lengths=True)
    a = c.arrays()
    a["actual_seq_lengths_kv"] = np.array([3, 10], np.int32)
    with pytest.raises(ExecutionError, match=r"\[SF-D2\] .*input 6 'actual_seq_lengths_kv' position 1: "
                                             r"expected a length in \[0, 9\] \(S2\), got 10"):
        _validate(a)


@pytest.mark.parametrize("row, fact", [
    ([0, 9, -1], "entry 1: expected -1 or a block id in [0, 9) (NB_b = ceil(S2b / 1)), got 9"),
    ([0, -1, 2], "entry 2: expected -1 (padding only after the last valid block id), got 2"),
    ([4, 1, 4], "entry 2: expected a block id not listed before (NB_b = 9), got 4, already at entry 0"),
    ([-2, -1, -1], "entry 0: expected -1 or a block id in [0, 9)"),
])
def test_sparse_indices_validation(row, fact):
    c = AttentionCase(mode=0, K=3)
    a = c.arrays()
    a["sparse_indices"][1, 2, 0] = row
    with pytest.raises(ExecutionError) as err:
        _validate(a, sparse_mode=0)
    message = str(err.value)
    assert message.startswith("[SA-D3] SparseFlashAttention 'node': input 3 'sparse_indices' row (b=1, s1=2, n2=0) ")
    assert fact in message and err.value.rule == "SA-D3"


def test_grad_validates_tnd_rows_and_ignores_unread_rows():
    c = AttentionCase(layout="TND", mode=3, K=3, tnd_q=[2, 5], tnd_kv=[4, 9])
    a = c.arrays()
    out = np.zeros(a["query"].shape[:-1] + (c.D2,), np.float16)
    stats = np.ones((1, a["query"].shape[0], 4), np.float32)
    feeds = {"query": a["query"], "key": a["key"], "sparse_indices": a["sparse_indices"], "d_out": out, "out": out,
             "softmax_max": stats, "softmax_sum": stats, "value": a["value"],
             "actual_seq_lengths_query": a["actual_seq_lengths_query"],
             "actual_seq_lengths_kv": a["actual_seq_lengths_kv"]}
    assert (a["sparse_indices"][5] == 10**6).all()        # row 5 belongs to no batch: garbage is fine
    _validate(feeds, SFA_GRAD, layout="TND")
    bad = a["sparse_indices"].copy()
    bad[3, 0] = [0, 0, -1]
    with pytest.raises(ExecutionError, match=r"\[SA-D3\] SparseFlashAttentionGrad 'node': input 2 'sparse_indices' "
                                             r"row \(t=3, n2=0\) entry 1: .*got 0, already at entry 0"):
        _validate(dict(feeds, sparse_indices=bad), SFA_GRAD, layout="TND")


# -- CANN example shapes (spec 4.10) -------------------------------------------------------------
def _check_graph_against_reference(c: AttentionCase, a: dict):
    g = fwd_grad_graph(c, a)
    dt = NP[c.dtype]
    d_out = np.random.default_rng(5).standard_normal(a["query"].shape[:-1] + (c.D2,)).astype(dt)
    r = geir.run(g, {k: v for k, v in a.items() if v is not None} | {"d_out": d_out})
    ref_out, _, _ = reference_forward(c, a, round_to=dt)
    assert_within_ulps_of_scale(r["attention_out"], ref_out, dt, what="attention_out")
    refs = reference_grad(c, a, d_out, r["attention_out"], r["softmax_max"], r["softmax_sum"], round_to=dt)
    for name, want in zip(GRAD_NAMES, refs):
        if want is not None:
            assert_within_ulps_of_scale(r[name], want, dt, what=name)


def test_aclnn_example_shapes_tnd_rope_and_sinks():
    for sinks in (False, True):
        c = AttentionCase(layout="TND", mode=0, N1=16, N2=1, D=512, D2=512, Dr=64, K=2048, dtype="float16", sinks=sinks,
                          tnd_q=[1], tnd_kv=[2048], seed=1)
        a = c.arrays()
        a = {k: (v[:1] if k in ("query", "query_rope", "sparse_indices") else v[:2048]
                 if k in ("key", "value", "key_rope") else v) for k, v in a.items()}
        if sinks:
            a["sinks"] = np.zeros(16, np.float32)
        _check_graph_against_reference(c, a)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_grad_tiling_ut_shapes(dtype):
    cases = [AttentionCase(B=1, S1=64, S2=128, N1=8, D=128, D2=128, K=4, bs=64, mode=3, dtype=dtype),
             AttentionCase(B=1, S1=64, S2=128, N1=8, D=128, D2=128, K=4, bs=64, mode=3, Dr=64, dtype=dtype),
             AttentionCase(layout="TND", N1=8, D=128, D2=128, K=4, bs=64, mode=3, tnd_q=[64], tnd_kv=[128],
                           dtype=dtype)]
    if dtype == "bfloat16":
        cases.append(AttentionCase(B=2, S1=32, S2=64, N1=16, D=128, D2=128, K=8, bs=64, mode=3, dtype=dtype))
    for c in cases:
        a = c.arrays()
        if c.layout == "TND":
            a = {k: (v[:64] if k in ("query", "sparse_indices") else v[:128] if k in ("key", "value") else v)
                 for k, v in a.items()}
        _check_graph_against_reference(c, a)


def test_forward_paramset_multi_batch_with_zero_lengths():
    c = AttentionCase(B=32, S1=6, S2=512, N1=64, D=64, D2=64, K=32, mode=3, lengths=True, dtype="bfloat16", seed=2)
    a = c.arrays()
    a["actual_seq_lengths_query"][:3] = 0
    a["actual_seq_lengths_kv"][3:5] = 0
    out, mx, sm = run_forward_kernel(c, a)
    ref_out, ref_mx, ref_sm = reference_forward(c, a, round_to=NP["bfloat16"])
    assert_within_ulps_of_scale(out, ref_out, NP["bfloat16"])
    np.testing.assert_allclose(mx, ref_mx, rtol=1e-5, atol=1e-6)
    assert not out[:3].astype(np.float32).any()


@pytest.mark.slow
def test_forward_paramset_bsnd_basic_long_kv():
    """bsnd_basic: f16 B=1 S1=5 S2=262144 N1=8 K=16 mode 0, lengths [4]/[4], D=512, Dr=64."""
    c = AttentionCase(B=1, S1=5, S2=262144, N1=8, D=512, D2=512, Dr=64, K=16, mode=0, lengths=True, dtype="float16")
    rng = np.random.default_rng(0)
    a = {"query": rng.standard_normal((1, 5, 8, 512)).astype(np.float16),
         "key": np.zeros((1, 262144, 1, 512), np.float16), "value": np.zeros((1, 262144, 1, 512), np.float16),
         "query_rope": rng.standard_normal((1, 5, 8, 64)).astype(np.float16),
         "key_rope": np.zeros((1, 262144, 1, 64), np.float16), "sinks": None,
         "actual_seq_lengths_query": np.array([4], np.int32), "actual_seq_lengths_kv": np.array([4], np.int32),
         "sparse_indices": np.full((1, 5, 1, 16), -1, np.int32)}
    a["key"][0, :4] = rng.standard_normal((4, 1, 512))
    a["value"][0, :4] = rng.standard_normal((4, 1, 512))
    a["key_rope"][0, :4] = rng.standard_normal((4, 1, 64))
    a["sparse_indices"][0, :4, 0, :4] = [3, 1, 0, 2]
    out, _, _ = run_forward_kernel(c, a)
    ref_out, _, _ = reference_forward(c, a, round_to=np.float16)
    assert_within_ulps_of_scale(out, ref_out, np.float16)
    assert not out[0, 4].any()   # s1 = 4 >= actual_seq_lengths_query


def test_tnd_basic_paramset():
    c = AttentionCase(layout="TND", N1=8, D=64, D2=64, Dr=16, K=32, mode=0, tnd_q=[4, 8], tnd_kv=[1111, 3000],
                      dtype="float16", seed=3)
    a = c.arrays()
    _check_graph_against_reference(c, a)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_intermediate_roundings_are_where_the_spec_puts_them(dtype):
    """Tolerances cannot see a missing rounding of P or dS; agreement bit for bit can.

    With the spec's roundings the kernel equals the rounding reference on (nearly) every
    element and the unrounded reference on only ~70%; a kernel that skipped them flips both.
    """
    c = AttentionCase(mode=0, K=16, S1=8, S2=32, N1=8, D=32, D2=32, dtype=dtype, seed=1)
    a = c.arrays()
    dt = NP[dtype]
    out, mx, sm = run_forward_kernel(c, a)
    d_out = np.random.default_rng(2).standard_normal(out.shape).astype(dt)
    got = (out,) + run_grad_kernel(c, a, d_out, out, mx, sm)[:3]
    rounded = (reference_forward(c, a, round_to=dt)[0],) + reference_grad(c, a, d_out, out, mx, sm, round_to=dt)[:3]
    exact = (reference_forward(c, a)[0],) + reference_grad(c, a, d_out, out, mx, sm)[:3]
    for name, x, r, e in zip(("attention_out",) + GRAD_NAMES[:3], got, rounded, exact):
        same_as_rounded = np.mean(x == r.astype(np.float32).astype(dt))
        same_as_exact = np.mean(x == e.astype(np.float32).astype(dt))
        assert same_as_rounded >= 0.9 and same_as_rounded > same_as_exact + 0.1, (name, same_as_rounded, same_as_exact)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_dense_and_scatter_accumulation_agree(monkeypatch, layout):
    """dK/dV go through a dense GEMM over the key span or a sort-and-add scatter: same sums."""
    c = AttentionCase(layout=layout, mode=3, bs=2, Dr=4, N2=2, N1=4, D2=6, kv_merge=layout == "TND", dtype="float64",
                      S2=30, K=3, seed=12, tnd_q=[5, 11], tnd_kv=[17, 40])
    a = c.arrays()
    value = a["value"] if a["value"] is not None else a["key"][..., :c.D2]
    out, mx, sm = run_forward_kernel(c, a, value)
    d_out = np.random.default_rng(0).standard_normal(out.shape)
    monkeypatch.setattr(kernels, "DENSE_SPAN_RATIO", 10**9)
    dense = run_grad_kernel(c, a, d_out, out, mx, sm)
    monkeypatch.setattr(kernels, "DENSE_SPAN_RATIO", 0)
    scattered = run_grad_kernel(c, a, d_out, out, mx, sm)
    reference = reference_grad(c, a, d_out, out, mx, sm)
    for x, y, r in zip(dense, scattered, reference):
        assert (x is None) == (y is None) == (r is None)
        if x is not None:
            np.testing.assert_allclose(x, r, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(y, r, rtol=1e-12, atol=1e-12)
