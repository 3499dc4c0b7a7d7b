"""Sparse attention rules CANN changed upstream, or that geir lacked (issue 27, item 3), each with its source."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from sparse_attention.helpers import SFA, SFA_GRAD, sfa_graph
from sparse_attention.test_sfa_paged import _attrs, _graph, _paged_base
from sparse_attention.test_sfa_schema import fwd_feeds, grad_feeds, z


def _sinks_forward():
    feeds = fwd_feeds("TND", T1=16, T2=2048, N1=16, D=512, D2=512, K=2048, Dr=64, sinks=z(16, dtype=np.float32))
    return sfa_graph(feeds, SFA, scale_value=0.1, layout_query="TND", layout_kv="TND", attention_mode=2)[0]


def test_sf_t10_sinks_off_ascend950_is_an_error():
    """ops-transformer attention/sparse_flash_attention/op_host/op_api/aclnn_sparse_flash_attention_v2.cpp @cd032267
    (2026): sinks off DAV_3510 return ACLNN_ERR_RUNTIME_ERROR ("only supported on Ascend950"); op_api UT
    test_aclnn_sparse_flash_attention.cpp @e1afc80b: sparse_flash_attention_v2_aclnn_a3_sinks_not_supported
    expects 361001. The code refuses it: level error, no longer doc/unsupported."""
    g = _sinks_forward()
    for target in ("ascend910b", "ascend910_93"):
        report = geir.check(g, target)
        assert not report.ok and [(v.rule, v.level) for v in report.violations] == [("SF-T10", "error")]
        assert report.violations[0].source.startswith("code") and "361001" in str(report)
    assert geir.check(g, "ascend950").ok


def test_pa_s6_no_longer_refuses_sinks_with_a_paged_cache_on_ascend950():
    """ops-transformer sparse_flash_attention_tiling.cpp @16de349b (2026-08): CheckSinks checks dtype and shape (N1,)
    only, for every layout_kv; issue 27: "sinks with a paged cache (PA_BSND) are allowed since 2026-08"."""
    case, paged = _paged_base()
    paged["sinks"] = np.zeros(4, np.float32)
    g = _graph(paged, **_attrs(case, layout_kv="PA_BSND"))
    assert "PA-S6" not in geir.check(g, "ascend950").rules()
    out = geir.run(g, {k: v for k, v in paged.items() if v is not None})     # and the reference runs it
    assert np.isfinite(out["attention_out"].astype(np.float32)).all()


def test_sg_t12_s2_up_to_1m():
    """aclnnSparseFlashAttentionGrad.md @05328cd9 (2026-08): "S1支持1~128K，S2支持1~1M" (was 128K for both)."""
    ok = grad_feeds("BSND", B=1, S1=1, S2=1048576 // 1024, N1=16, D=512, D2=512, K=1024, Dr=64)
    # only shapes matter to the rule: graphs declared with S2 = 1M and 1M + 1 (never run)
    for s2, fires in ((1048576, False), (1048577, True), (131073, False)):
        b = geir.GraphBuilder("g")
        shapes = {k: np.shape(v) for k, v in ok.items() if v is not None}
        shapes.update(key=(1, s2, 1, 512), value=(1, s2, 1, 512), key_rope=(1, s2, 1, 64))
        ins = {k: b.input(k, np.asarray(ok[k]).dtype, shapes[k]) for k in shapes}
        ins["value"] = ins["key"]
        b.output(b.SparseFlashAttentionGrad(**ins, scale_value=0.1, name="node")[0], "d_query")
        report = geir.check(b.build(), "ascend910b")
        assert ("SG-T12" in report.rules()) is fires, (s2, str(report))
        if fires:
            assert f"expected S2 <= 1048576, got {s2}" in str(report)
    s1 = grad_feeds("BSND", B=1, S1=131073 // 4096, S2=8, N1=16, D=512, D2=512, K=1024, Dr=64)
    assert "SG-T12" not in geir.check(sfa_graph(s1, SFA_GRAD, scale_value=0.1, value_is_key=True)[0],
                                      "ascend950").rules()


def test_sg_t13_value_must_be_the_key_tensor():
    """aclnnSparseFlashAttentionGrad.md @05328cd9, 公共约束: "当前只支持value和key完全一致的场景". In a graph the same
    tensor is the same Value (or value absent: KV merge, where the grad reads key as value). Doc-only: unsupported."""
    feeds = grad_feeds("TND", T1=16, T2=2048, N1=16, D=512, D2=512, K=2048, Dr=64)
    separate = sfa_graph(feeds, SFA_GRAD, scale_value=0.1, layout="TND")[0]
    for target in ("ascend910b", "ascend910_93", "ascend950"):
        report = geir.check(separate, target)
        assert report.ok and [(v.rule, v.level) for v in report.unsupported] == [("SG-T13", "unsupported")]
        assert "input 7 'value': expected the same tensor as input 1 'key' (or None: KV merge), got a different " \
               "tensor" in str(report)
        assert not geir.check(separate, target, strict=True).ok
    same = sfa_graph(feeds, SFA_GRAD, scale_value=0.1, layout="TND", value_is_key=True)[0]
    assert all("SG-T13" not in geir.check(same, t).rules() for t in ("ascend910b", "ascend910_93", "ascend950"))
    merged = sfa_graph(dict(feeds, value=None), SFA_GRAD, scale_value=0.1, layout="TND")[0]
    assert "SG-T13" not in geir.check(merged, "ascend910b").rules()


@pytest.mark.parametrize("breaking, rule", [({"block_table": None}, "PA-S2"), ({"actual_seq_lengths_kv": None}, "PA-S3"),
                                            ({}, "PA-S5")])
def test_a_tnd_query_with_a_paged_cache_the_tiling_rejects_names_layout_kv(breaking, rule):
    """CANN's tiling UT SparseFlashAttention_910b_tiling_8 (tests/ut/op_host/arch22, a TND query with PA_BSND and no
    block_table: "the layout_kv is PA_BSND, blockTable must be provided") and _13 ("when return_softmax_lse is true,
    key layout do not support PA_BSND"); issue 27: the message names layout_kv."""
    from sparse_attention.helpers import AttentionCase, paged_arrays
    case = AttentionCase(layout="TND", mode=3, S2=32, D=16, D2=16, Dr=8, lengths=True, seed=13)
    paged = paged_arrays(case.arrays(), "TND", 16, np.random.default_rng(5))
    paged.update(breaking)
    with pytest.raises(geir.GraphError) as err:
        _graph(paged, **_attrs(case, layout_kv="PA_BSND", return_softmax_lse=rule == "PA-S5"))
    assert err.value.rule == rule and "layout_kv" in str(err.value) and "PA_BSND" in str(err.value), str(err.value)
