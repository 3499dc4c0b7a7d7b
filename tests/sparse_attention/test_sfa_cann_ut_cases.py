"""CANN's own parameter-check cases of the sparse attention ops, as a table: each case of ops-transformer's UT that
CANN's tiling or infershape rejects must be rejected by geir too (a GraphError at build, or a geir.check error on the
target of that UT), with the rule id in the message; each case CANN accepts must build and pass.

Sources (read, facts only; the yuanfang-chen/ops-transformer mirror): ``attention/sparse_flash_attention/tests/ut/
op_host/arch32/test_sparse_flash_attention_tiling.cpp`` (cases ``SparseFlashAttention_910b_tiling_0`` .. ``_12``,
Ascend910B), ``attention/sparse_flash_attention/tests/ut/op_host/test_sparse_flash_attention_infershape.cpp``
(inferred shapes). Shapes are given without data: building a graph allocates nothing, so CANN's sizes are used as
they are. The MoE ops' UT cases are in tests/moe/test_moe_cann_ut_cases.py.
"""

from __future__ import annotations

import pytest

import geir

Q, K, V, IDX, TABLE, AQ, AKV, QR, KR = ("query", "key", "value", "sparse_indices", "block_table",
                                        "actual_seq_lengths_query", "actual_seq_lengths_kv", "query_rope", "key_rope")
INT_INPUTS = {IDX, TABLE, AQ, AKV}


def _bsnd_pa_big(**changes):
    """The shapes most of CANN's 910B cases start from: BSND query, a 4-batch cache with 65536-row pages."""
    shapes = {Q: (4, 1, 128, 512), K: (4, 65536, 1, 512), V: (4, 65536, 1, 512), IDX: (4, 1, 1, 16),
              TABLE: (4, 1024), AQ: (4,), AKV: (4,), QR: (4096, 64, 1, 512), KR: (4096, 64, 1, 512)}
    shapes.update(changes)
    return shapes


def _tnd_pa(**changes):
    shapes = {Q: (184320, 4, 512), K: (10, 65488, 1, 512), V: (10, 65488, 1, 512), IDX: (184320, 1, 16),
              TABLE: (10, 128), AQ: (10,), AKV: (10,), QR: (753, 512, 1, 512), KR: (753, 512, 1, 512)}
    shapes.update(changes)
    return shapes


def _small(**changes):
    shapes = {Q: (1, 128, 128, 512), K: (1, 128, 1, 512), V: (1, 128, 1, 512), IDX: (1, 128, 1, 2048),
              TABLE: (1, 1), AQ: (1,), AKV: (1,), QR: (1, 128, 128, 64), KR: (1, 128, 1, 64)}
    shapes.update(changes)
    return shapes


def _attrs(layout_query="BSND", layout_kv="PA_BSND", bs=64, mode=3, attention_mode=0, lse=False):
    return dict(scale_value=0.0416666666666667, sparse_block_size=bs, layout_query=layout_query, layout_kv=layout_kv,
                sparse_mode=mode, attention_mode=attention_mode, return_softmax_lse=lse)


# (CANN case, CANN's comment, shapes (None: input absent), attributes, the rules geir may answer with; () = accepted)
CASES = [
    ("tiling_0", "BNSD failed", _bsnd_pa_big(), _attrs(), {"SA-S3"}),            # query_rope B 4096 vs 4
    ("tiling_1", "TND_TND failed",
     {Q: (2, 128, 512), K: (2, 1, 512), V: (2, 1, 512), IDX: (2, 1, 206), TABLE: (4, 1024), AQ: (2,), AKV: (2,),
      QR: None, KR: None}, _attrs("TND", "TND", bs=16, mode=0, lse=True), {"PA-S2"}),
    ("tiling_2", "BNSD_BNSD failed", _bsnd_pa_big(), _attrs("BSND", "BSND"), {"PA-S2"}),  # a table, not paged
    ("tiling_3", "TND_PA_BSND failed", _tnd_pa(), _attrs("TND", bs=2), {"SA-S2"}),   # query_rope rank 4
    ("tiling_4", "attention_mode = 2", _bsnd_pa_big(), _attrs(attention_mode=2), {"SA-S3"}),
    ("tiling_5", "query_rope dim 3 = 64 failed", _bsnd_pa_big(**{QR: (4096, 64, 1, 64), KR: (4096, 64, 1, 64)}),
     _attrs(attention_mode=2), {"SA-S3"}),
    ("tiling_6", "0 < blockSize_ < 1024 failed", _small(**{QR: (1, 128, 1, 64)}), _attrs(bs=1, attention_mode=2),
     {"SA-S3"}),
    ("tiling_7", "0 < blockSize_ < 1024 success", _small(), _attrs(bs=1, attention_mode=2), ()),
    ("tiling_8", "block_table is nullptr failed", _tnd_pa(**{TABLE: None}), _attrs("TND", bs=2), {"PA-S2"}),
    ("tiling_9", "block_table is nullptr failed", _tnd_pa(**{TABLE: (1, 2, 1)}), _attrs("TND", bs=2), {"PA-S2"}),
    ("tiling_10", "block_table is nullptr failed", _tnd_pa(**{TABLE: (1, "max_blocks")}), _attrs("TND", bs=2),
     {"SA-S2"}),                                          # dim -1 as a symbol; query_rope rank 4 is refused first
    ("tiling_11", "layout_kv TND with a BSND query", _bsnd_pa_big(), _attrs("BSND", "TND"), {"SA-S1c"}),
    ("tiling_12", "kvStorageMode_ = 0 failed", _small(), _attrs("BSND", "BSND", bs=1, attention_mode=2), {"PA-S2"}),
]


def _build(shapes: dict, attrs: dict) -> geir.Graph:
    b = geir.GraphBuilder("cann_ut")
    inputs = {name: b.input(name, "int32" if name in INT_INPUTS else "bfloat16", shape)
              for name, shape in shapes.items() if shape is not None}
    out = b.SparseFlashAttention(**inputs, **attrs)
    b.output(out[0], "attention_out")
    return b.build()


@pytest.mark.parametrize("case, comment, shapes, attrs, rules", CASES, ids=[c[0] for c in CASES])
def test_sparse_flash_attention_910b_tiling_cases(case, comment, shapes, attrs, rules):
    if not rules:
        report = geir.check(_build(shapes, attrs), "ascend910b")
        assert report.ok and not report.violations, str(report)
        return
    try:
        graph = _build(shapes, attrs)
    except geir.GraphError as err:
        assert err.rule in rules and f"[{err.rule}]" in str(err), (case, comment, str(err))
        return
    report = geir.check(graph, "ascend910b")
    assert not report.ok and report.rules() & set(rules), (case, comment, str(report))


def test_sparse_flash_attention_infershape_2_infers_canns_shapes():
    """SparseFlashAttention_infershape_2: BSND fp16, per-batch lengths, lse on -> CANN's expected output shapes.
    (Its cases 0 and 1 only test shape inference, which CANN runs without checks; the same shapes are refused by
    its tiling, tiling_0 and tiling_1 above, and by geir.)"""
    b = geir.GraphBuilder("cann_ut_infershape")
    shapes = {Q: (3, 13754, 8, 512), K: (3, 13754, 1, 512), V: (3, 13754, 1, 512), IDX: (3, 13754, 1, 32),
              AQ: (3,), AKV: (3,)}
    inputs = {n: b.input(n, "int32" if n in INT_INPUTS else "float16", shape) for n, shape in shapes.items()}
    out, mx, sm = b.SparseFlashAttention(**inputs, **_attrs("BSND", "BSND", lse=True))
    for value, name in ((out, "attention_out"), (mx, "softmax_max"), (sm, "softmax_sum")):
        b.output(value, name)
    graph = b.build()
    assert [v.shape for v in graph.outputs] == [(3, 13754, 8, 512), (3, 1, 13754, 8), (3, 1, 13754, 8)]
    assert [v.dtype.value for v in graph.outputs] == ["float16", "float32", "float32"]
