"""Reference of the sparse flash-attention ops, transcribed from the spec's loops (spec 4.5-4.7).

Python loops over batches, heads and query rows; positions from the spec's ``select`` on
lists. ``round_to`` applies the spec's intermediate roundings (to float16/bfloat16) to
float64 values; None computes everything in float64 without rounding.
"""

from __future__ import annotations

import numpy as np


def select(row, thr, bs):
    if thr <= 0:
        return []
    n_valid = min(len(row), -(-thr // bs))
    pos = []
    for i in range(n_valid):
        if row[i] == -1:
            break
        beg = int(row[i]) * bs
        if beg >= thr:
            continue
        pos += range(beg, min(beg + bs, thr))
    return pos


def batches(layout, query_shape, key_shape, aq, akv, honor_bsnd_lengths):
    """Yield (b, S1b, S2b, qrow(s1) -> index tuple prefix, kvrow(j) -> index tuple prefix, stats(s1, n2))."""
    if layout == "BSND":
        B, S1, S2 = query_shape[0], query_shape[1], key_shape[1]
        for b in range(B):
            s1b = int(aq[b]) if (aq is not None and honor_bsnd_lengths) else S1
            s2b = int(akv[b]) if (akv is not None and honor_bsnd_lengths) else S2
            yield (b, s1b, s2b, lambda s1, b=b: (b, s1), lambda j, b=b: (b, j),
                   lambda s1, n2, b=b: (b, n2, s1))
    else:
        for b in range(len(aq)):
            q0 = int(aq[b - 1]) if b > 0 else 0
            k0 = int(akv[b - 1]) if b > 0 else 0
            yield (b, int(aq[b]) - q0, int(akv[b]) - k0, lambda s1, q0=q0: (q0 + s1,), lambda j, k0=k0: (k0 + j,),
                   lambda s1, n2, q0=q0: (n2, q0 + s1))


def _query_and_keys(query, key, query_rope, key_rope, q_index, kv):
    """The row's query heads and selected keys, rope parts appended (spec: Qf, Kf)."""
    Qf = query[q_index]
    Kf = np.stack([key[r] for r in kv])
    if query_rope is not None:
        Qf = np.concatenate([Qf, query_rope[q_index]], -1)
        Kf = np.concatenate([Kf, np.stack([key_rope[r] for r in kv])], -1)
    return Qf, Kf


def _rnd(x, round_to):
    if round_to is None:
        return x
    return np.asarray(x, np.float64).astype(np.float32).astype(round_to).astype(np.float64)


def forward_reference(query, key, value, indices, *, scale, bs=1, layout="BSND", mode=3, aq=None, akv=None,
                      query_rope=None, key_rope=None, sinks=None, round_to=None):
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    query, key, value, query_rope, key_rope, sinks = map(f, (query, key, value, query_rope, key_rope, sinks))
    N1, N2 = query.shape[-2], key.shape[-2]
    G = N1 // N2
    D2 = value.shape[-1]
    out = np.zeros(query.shape[:-1] + (D2,))
    stats_shape = (query.shape[0], N2, query.shape[1], G) if layout == "BSND" else (N2, query.shape[0], G)
    mx, sm = np.zeros(stats_shape), np.zeros(stats_shape)
    for _, S1b, S2b, qrow, kvrow, st_idx in batches(layout, query.shape, key.shape, aq, akv, True):
        for n2 in range(N2):
            heads = slice(n2 * G, n2 * G + G)
            for s1 in range(S1b):
                q = qrow(s1)
                st = st_idx(s1, n2)
                thr = S2b if mode == 0 else S2b - S1b + s1 + 1
                if mode == 3 and thr <= 0:
                    continue
                pos = select(indices[q + (n2,)], thr, bs)
                if not pos:
                    if sinks is not None:
                        mx[st], sm[st] = sinks[heads], 1.0
                    continue
                kv = [kvrow(j) + (n2,) for j in pos]
                Qf, Kf = _query_and_keys(query, key, query_rope, key_rope, q + (heads,), kv)
                V = np.stack([value[r] for r in kv])
                x = (Qf @ Kf.T) * scale
                m = x.max(-1)
                if sinks is not None:
                    m = np.maximum(m, sinks[heads])
                e = np.exp(x - m[:, None])
                total = e.sum(-1) + (np.exp(sinks[heads] - m) if sinks is not None else 0)
                out[q + (heads,)] = _rnd(e / total[:, None], round_to) @ V
                mx[st], sm[st] = m, total
    return _rnd(out, round_to), mx, sm


def grad_reference(query, key, indices, d_out, out, softmax_max, softmax_sum, *, scale, value=None, bs=1,
                   layout="BSND", mode=3, aq=None, akv=None, query_rope=None, key_rope=None, round_to=None):
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    query, key, value, d_out, out, query_rope, key_rope = map(f, (query, key, value, d_out, out, query_rope, key_rope))
    N1, N2 = query.shape[-2], key.shape[-2]
    G = N1 // N2
    D, D2 = query.shape[-1], d_out.shape[-1]
    Dr = 0 if query_rope is None else query_rope.shape[-1]
    dQ = np.zeros(query.shape[:-1] + (D + Dr,))
    dK = np.zeros(key.shape[:-1] + (D + Dr,))
    dV = np.zeros(key.shape[:-1] + (D2,))
    for _, S1b, S2b, qrow, kvrow, st_idx in batches(layout, query.shape, key.shape, aq, akv, False):
        for n2 in range(N2):
            heads = slice(n2 * G, n2 * G + G)
            for s1 in range(S1b):
                q = qrow(s1)
                thr = S2b if mode == 0 else S2b - S1b + s1 + 1
                pos = select(indices[q + (n2,)], thr, bs)
                if not pos:
                    continue
                kv = [kvrow(j) + (n2,) for j in pos]
                Qf, Kf = _query_and_keys(query, key, query_rope, key_rope, q + (heads,), kv)
                V = np.stack([value[r] for r in kv]) if value is not None else np.stack([key[r][:D2] for r in kv])
                dO, O = d_out[q + (heads,)], out[q + (heads,)]
                st = st_idx(s1, n2)
                m, total = np.asarray(softmax_max[st], np.float64), np.asarray(softmax_sum[st], np.float64)
                P = np.exp(scale * (Qf @ Kf.T) - m[:, None]) / total[:, None]
                dv = _rnd(P, round_to).T @ dO
                dS = P * (dO @ V.T - (dO * O).sum(-1)[:, None])
                dSr = _rnd(dS, round_to)
                dQ[q + (heads,)] = scale * (dSr @ Kf)
                dk = scale * (dSr.T @ Qf)
                for i, r in enumerate(kv):
                    dV[r] += dv[i]
                    dK[r] += dk[i]
    if value is None:
        dK[..., :D2] += dV
    r = lambda x: _rnd(x, round_to)  # noqa: E731
    return (r(dQ[..., :D]), r(dK[..., :D]), None if value is None else r(dV),
            None if query_rope is None else r(dQ[..., D:]), None if query_rope is None else r(dK[..., D:]))
