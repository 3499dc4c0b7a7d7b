"""Float64 reference of the MoE unpermute ops, transcribed from the spec's loops (spec 3.3).

Loops over tokens and slots, explicit drop/skip rules: nothing shared with the kernels.
Each function also returns the magnitude (sum of absolute terms) of every result element.
"""

from __future__ import annotations

import numpy as np


def unpermute_reference(P, s, probs=None):
    P = np.asarray(P, np.float64)
    K = probs.shape[1] if probs is not None else 1
    Tn, R = s.shape[0] // K, P.shape[0]
    out = np.zeros((Tn, P.shape[1]))
    mag = np.zeros_like(out)
    for t in range(Tn):
        for k in range(K):
            r = int(s[t * K + k])
            if r >= R:
                continue
            if probs is None:
                out[t] += P[r]
                mag[t] += abs(P[r])
                continue
            p = float(probs[t, k])
            if p == 0:
                continue
            out[t] += P[r] * p
            mag[t] += abs(P[r] * p)
    return out, mag


def unpermute_grad_reference(P, dY, s, probs=None):
    dY = np.asarray(dY, np.float64)
    Tn, M = dY.shape[0], s.shape[0]
    ptg = np.zeros((M, dY.shape[1]))
    if probs is None:
        for t in range(Tn):
            ptg[s[t]] = dY[t]
        return ptg, np.abs(ptg), np.zeros((Tn, 1)), np.zeros((Tn, 1))
    K = probs.shape[1]
    pg = np.zeros((Tn, K))
    pg_mag = np.zeros((Tn, K))
    for t in range(Tn):
        for k in range(K):
            r = int(s[t * K + k])
            ptg[r] = dY[t] * float(probs[t, k])
            terms = np.asarray(P[r], np.float64) * dY[t]
            pg[t, k] = terms.sum()
            pg_mag[t, k] = np.abs(terms).sum()
    return ptg, np.abs(ptg), pg, pg_mag
