"""The sparse attention family's one statement of which keys a query row sees (``selection.py``),
and every implementation checked against it: the NumPy kernel, the ONNX body on plain ONNX
Runtime, and geir's onnxruntime runtime.

The probe: a zero query gives every visible key the same score, and a one-hot value per key row
makes ``attention_out`` the attention weights, so a row's nonzero columns are the keys it saw,
each with weight exactly 1 / (number of keys seen).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import geir
from geir.schemas.sparse_attention.selection import candidates, query_rows
from oracles.onnx_runners import run_onnxruntime
from sparse_attention.helpers import AttentionCase


def _probe(case: AttentionCase) -> tuple[geir.Graph, dict[str, np.ndarray]]:
    a = case.arrays()
    key_rows = int(np.prod(a["key"].shape[:-2]))
    value = np.zeros(a["key"].shape[:-1] + (key_rows,), np.float16)
    flat = value.reshape(key_rows, case.N2, key_rows)
    flat[np.arange(key_rows), :, np.arange(key_rows)] = 1.0       # key row r -> column r (BSND: b*S2 + j)
    if case.layout == "BSND":                                       # per batch, columns of that batch only
        value = value.reshape(case.B, case.S2, case.N2, case.B, case.S2).sum(axis=3).astype(np.float16)
    feeds = {"query": np.zeros_like(a["query"]), "key": a["key"], "value": value,
             "sparse_indices": a["sparse_indices"]}
    for name in ("actual_seq_lengths_query", "actual_seq_lengths_kv"):
        if a[name] is not None:
            feeds[name] = a[name]
    b = geir.GraphBuilder("selection_probe")
    inputs = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items()}
    out = b.SparseFlashAttention(**inputs, scale_value=1.0, sparse_block_size=case.bs, layout_query=case.layout,
                                 layout_kv=case.layout, sparse_mode=case.mode)
    b.output(out if not isinstance(out, tuple) else out[0], "attention_out")
    return b.build(), feeds


def _expected(case: AttentionCase, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The weights the statement implies, shaped as attention_out: 1/count on each visible key."""
    q = feeds["query"]
    total = int(np.prod(q.shape[:-2]))
    rows = query_rows(case.layout, total, case.S1, case.S2, feeds.get("actual_seq_lengths_query"),
                      feeds.get("actual_seq_lengths_kv"), case.mode)
    entries = feeds["sparse_indices"].reshape(total, case.N2, case.K)
    threshold = np.where(rows.active, rows.threshold, 0)
    positions, valid = candidates(entries, threshold, case.bs, int(rows.s2_len.max(initial=0)))
    columns = feeds["value"].shape[-1]
    offset = 0 if case.layout == "BSND" else rows.kv_start      # BSND columns are batch-relative
    weights = np.zeros((total, case.N2, columns))
    for r, n2 in itertools.product(range(total), range(case.N2)):   # the oracle, not a hot path
        seen = np.unique(positions[r, n2][valid[r, n2]] + (0 if case.layout == "BSND" else offset[r]))
        if seen.size:
            weights[r, n2, seen] = 1.0 / seen.size
    group = case.N1 // case.N2
    return np.repeat(weights, group, axis=1).reshape(q.shape[:-1] + (columns,))


CASES = [AttentionCase(layout=layout, mode=mode, bs=bs, lengths=lengths, N2=n2, N1=2 * n2, S2=9, D=16, seed=seed)
         for layout, mode, bs, lengths, n2, seed in itertools.product(("BSND", "TND"), (0, 3), (1, 2, 3), (False, True),
                                                                       (1, 2), (0,))
         if not (layout == "TND" and lengths)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.layout}-mode{c.mode}-bs{c.bs}-len{c.lengths}-n2{c.N2}")
def test_every_implementation_sees_the_keys_the_statement_selects(case):
    graph, feeds = _probe(case)
    want = _expected(case, feeds)
    tolerance = 1e-3                                               # 1/count rounded to float16
    results = {"numpy": geir.run(graph, feeds)["attention_out"],
               "onnx body": run_onnxruntime(geir.to_onnx(graph), feeds)["attention_out"],
               "onnxruntime": geir.run(graph, feeds, runtime="onnxruntime")["attention_out"]}
    for name, got in results.items():
        got = got.astype(np.float64)
        assert np.array_equal(got != 0, want != 0), f"{name}: a row saw other keys than the statement selects"
        assert np.allclose(got, want, atol=tolerance, rtol=0), name
