"""Schemas, semantic rules and target rules of the sparse flash-attention ops (spec 4.1-4.4)."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir import GeirWarning, GraphError
from geir.schemas import get_schema
from sparse_attention.helpers import SFA, SFA_GRAD, sfa_graph

F16 = np.float16


def z(*shape, dtype=F16):
    return np.zeros(shape, dtype)


def fwd_feeds(layout="BSND", B=1, S1=4, S2=8, N1=4, N2=1, D=8, D2=8, K=2, Dr=0, T1=6, T2=10, **extra):
    if layout == "BSND":
        q, k, v, idx = z(B, S1, N1, D), z(B, S2, N2, D), z(B, S2, N2, D2), z(B, S1, N2, K, dtype=np.int32)
        rope = (z(B, S1, N1, Dr), z(B, S2, N2, Dr)) if Dr else (None, None)
        lengths = {}
    else:
        q, k, v, idx = z(T1, N1, D), z(T2, N2, D), z(T2, N2, D2), z(T1, N2, K, dtype=np.int32)
        rope = (z(T1, N1, Dr), z(T2, N2, Dr)) if Dr else (None, None)
        lengths = {"actual_seq_lengths_query": np.array([T1], np.int32), "actual_seq_lengths_kv": np.array([T2], np.int32)}
    feeds = {"query": q, "key": k, "value": v, "sparse_indices": idx, "query_rope": rope[0], "key_rope": rope[1]}
    feeds.update(lengths)
    feeds.update(extra)
    return feeds


def grad_feeds(layout="BSND", B=1, S1=4, S2=8, N1=4, N2=1, D=8, D2=8, K=2, Dr=0, T1=6, T2=10, merge=False, **extra):
    f = fwd_feeds(layout, B, S1, S2, N1, N2, D, D2, K, Dr, T1, T2)
    G = N1 // N2 if N2 else 1
    out = z(*(f["query"].shape[:-1] + (D2,)))
    stats = z(B, N2, S1, G, dtype=np.float32) if layout == "BSND" else z(N2, T1, G, dtype=np.float32)
    feeds = {"query": f["query"], "key": f["key"], "sparse_indices": f["sparse_indices"], "d_out": out, "out": out.copy(),
             "softmax_max": stats, "softmax_sum": stats.copy(), "value": None if merge else f["value"],
             "query_rope": f["query_rope"], "key_rope": f["key_rope"]}
    for name in ("actual_seq_lengths_query", "actual_seq_lengths_kv"):
        if name in f:
            feeds[name] = f[name]
    feeds.update(extra)
    return feeds


def _fails(op, feeds, rule, *facts, **attrs):
    attrs.setdefault("scale_value", 0.125)
    with pytest.raises(GraphError) as err:
        sfa_graph(feeds, op, **attrs)
    message = str(err.value)
    assert err.value.rule == rule and message.startswith(f"[{rule}] {op} 'node': "), message
    for fact in facts:
        assert fact in message, (fact, message)


def test_schemas_match_the_contract_tables():
    fwd, grad = get_schema(SFA), get_schema(SFA_GRAD)
    assert [i.name for i in fwd.inputs] == ["query", "key", "value", "sparse_indices", "block_table",
                                           "actual_seq_lengths_query", "actual_seq_lengths_kv", "query_rope",
                                           "key_rope", "sinks"]
    assert [i.name for i in grad.inputs] == ["query", "key", "sparse_indices", "d_out", "out", "softmax_max",
                                            "softmax_sum", "value", "actual_seq_lengths_query",
                                            "actual_seq_lengths_kv", "query_rope", "key_rope"]
    assert grad.inputs[7].optional and not grad.inputs[6].optional
    assert [o.name for o in fwd.outputs] == ["attention_out", "softmax_max", "softmax_sum"]
    assert [(o.name, o.optional) for o in grad.outputs] == [("d_query", False), ("d_key", False), ("d_value", True),
                                                            ("d_query_rope", True), ("d_key_rope", True)]
    assert [(a.name, a.kind.value, a.default) for a in fwd.attributes][1:] == [
        ("sparse_block_size", "Int", 1), ("layout_query", "String", "BSND"), ("layout_kv", "String", "BSND"),
        ("sparse_mode", "Int", 3), ("pre_tokens", "Int", 9223372036854775807),
        ("next_tokens", "Int", 9223372036854775807), ("attention_mode", "Int", 0), ("return_softmax_lse", "Bool", False)]
    assert fwd.attributes[0].name == "scale_value" and fwd.attributes[0].required
    assert [(a.name, a.default) for a in grad.attributes][1:] == [
        ("sparse_block_size", 1), ("layout", "BSND"), ("sparse_mode", 3), ("pre_tokens", 2147483647),
        ("next_tokens", 2147483647), ("deterministic", False)]
    assert len(fwd.type_combinations) == len(grad.type_combinations) == 2


def test_scale_value_is_required():
    with pytest.raises(GraphError, match=r"\[SCH-4\] SparseFlashAttention 'node': attribute 'scale_value'"):
        sfa_graph(fwd_feeds(), SFA)


def test_forward_inference_bsnd_and_tnd():
    g, _ = sfa_graph(fwd_feeds(B=2, S1=3, N1=8, N2=2, D=16, D2=12), SFA, scale_value=0.1)
    assert [str(v.type) for v in g.outputs] == ["float16[2,3,8,12]", "float32[0]", "float32[0]"]
    g, _ = sfa_graph(fwd_feeds(B=2, S1=3, N1=8, N2=2, D=16, D2=12), SFA, scale_value=0.1, return_softmax_lse=True)
    assert [str(v.type) for v in g.outputs][1:] == ["float32[2,2,3,4]", "float32[2,2,3,4]"]
    g, _ = sfa_graph(fwd_feeds("TND", N1=8, N2=2), SFA, scale_value=0.1, layout_query="TND", layout_kv="TND",
                     return_softmax_lse=True)
    assert [str(v.type) for v in g.outputs] == ["float16[6,8,8]", "float32[2,6,4]", "float32[2,6,4]"]


def test_grad_inference_and_optional_outputs():
    g, _ = sfa_graph(grad_feeds(Dr=4), SFA_GRAD, scale_value=0.1)
    assert [v.name for v in g.outputs] == ["d_query", "d_key", "d_value", "d_query_rope", "d_key_rope"]
    assert g.outputs[3].shape == (1, 4, 4, 4)
    g, _ = sfa_graph(grad_feeds(merge=True), SFA_GRAD, scale_value=0.1)
    assert [v.name for v in g.outputs] == ["d_query", "d_key"]
    b = geir.GraphBuilder("tuple")
    f = grad_feeds(merge=True)
    vals = {k: b.input(k, v.dtype, v.shape) for k, v in f.items() if v is not None}
    results = b.SparseFlashAttentionGrad(**vals, scale_value=0.5)
    assert len(results) == 5 and results[2] is None and results[3] is None and results[4] is None


def test_layout_rules():
    _fails(SFA, fwd_feeds(), "SA-S1", "attribute 'layout_query': expected BSND or TND, got 'BSH'", layout_query="BSH")
    _fails(SFA_GRAD, grad_feeds(), "SA-S1", "attribute 'layout': expected BSND or TND, got 'BSH'", layout="BSH")
    _fails(SFA, fwd_feeds(), "PA-S2", "input 4 'block_table': expected a (B, max_blocks) int32 table", layout_kv="PA_BSND")
    _fails(SFA, fwd_feeds(), "SA-S1c", "attribute 'layout_kv': expected 'BSND' (layout_query", layout_kv="TND")
    _fails(SFA, fwd_feeds(block_table=z(1, 4, dtype=np.int32)), "PA-S2", "input 4 'block_table': expected None")


def test_rank_and_shape_rules():
    _fails(SFA_GRAD, grad_feeds(query=z(4, 4, 8)), "SA-S2", "input 0 'query': expected rank 4 (layout BSND), got rank 3")
    _fails(SFA, fwd_feeds(key=z(2, 8, 1, 8)), "SA-S3", "input 1 'key' dim 0: expected 1 (B, dim 0 of input 0 'query')",
           "got 2")
    _fails(SFA, fwd_feeds(sparse_indices=z(1, 5, 1, 2, dtype=np.int32)), "SA-S3", "input 3 'sparse_indices' dim 1",
           "expected 4 (S1")
    _fails(SFA, fwd_feeds(value=z(1, 7, 1, 8)), "SA-S3", "input 2 'value' dim 1: expected 8 (S2, dim 1 of input 1 'key')")
    _fails(SFA, fwd_feeds(sparse_indices=z(1, 4, 2, 2, dtype=np.int32)), "SA-S3", "input 3 'sparse_indices' dim 2",
           "expected 1 (N2")
    _fails(SFA, fwd_feeds(N1=3, N2=2, sparse_indices=z(1, 4, 2, 2, dtype=np.int32)), "SA-S4",
           "input 0 'query' dim 2: expected a multiple of N2 = 2", "got 3")
    _fails(SFA, fwd_feeds(key=z(1, 8, 1, 6), value=z(1, 8, 1, 6)), "SA-S5", "input 1 'key' dim 3",
           "expected 8 (D, dim 3 of input 0 'query')", "got 6")
    _fails(SFA, fwd_feeds(D2=12), "SA-S5", "input 2 'value' dim 3: expected <= D = 8 (D2 <= D), got 12")
    _fails(SFA_GRAD, grad_feeds(D2=12, merge=True), "SA-S5", "input 3 'd_out' dim 3: expected <= D = 8")


def test_rope_rules():
    f = fwd_feeds(Dr=4)
    f["key_rope"] = None
    _fails(SFA, f, "SA-S6", "input 8 'key_rope': expected a tensor (query_rope and key_rope come together), got None")
    _fails(SFA, fwd_feeds(Dr=4, key_rope=z(1, 8, 1, 6)), "SA-S6", "input 8 'key_rope' dim 3: expected 4 (Dr")


def test_length_rules():
    tnd = fwd_feeds("TND")
    del tnd["actual_seq_lengths_kv"]
    _fails(SFA, tnd, "SA-S7", "input 6 'actual_seq_lengths_kv': expected a cumulative length tensor (TND needs both)",
           layout_query="TND", layout_kv="TND")
    _fails(SFA, fwd_feeds("TND", actual_seq_lengths_kv=np.array([3, 10], np.int32)), "SA-S7",
           "input 6 'actual_seq_lengths_kv' dim 0: expected 1 (B, the length of input 5", layout_query="TND",
           layout_kv="TND")
    _fails(SFA_GRAD, grad_feeds("TND", actual_seq_lengths_query=np.zeros((1, 1), np.int32)), "SA-S7",
           "expected rank 1 (B,)", layout="TND")
    _fails(SFA, fwd_feeds(B=2, actual_seq_lengths_query=np.array([4], np.int32)), "SA-S7b",
           "input 5 'actual_seq_lengths_query' dim 0: expected 2 (B), got 1", "not broadcast")
    _fails(SFA_GRAD, grad_feeds(actual_seq_lengths_kv=np.zeros((2, 2), np.int32)), "SA-S7c", "expected rank 1")
    with pytest.warns(GeirWarning, match=r"\[SG-W1\] SparseFlashAttentionGrad 'node': input 9 'actual_seq_lengths_kv'.*"
                                         r"the grad ignores BSND lengths"):
        sfa_graph(grad_feeds(actual_seq_lengths_kv=np.array([8], np.int32)), SFA_GRAD, scale_value=0.5)


def test_attribute_rules():
    _fails(SFA, fwd_feeds(), "SA-S8", "attribute 'sparse_mode': expected 0 (no mask) or 3 (bottom-right causal), got 2",
           sparse_mode=2)
    _fails(SFA_GRAD, grad_feeds(), "SA-S8", "attribute 'sparse_block_size': expected >= 1, got 0", sparse_block_size=0)
    _fails(SFA, fwd_feeds(), "SA-S8", "attribute 'scale_value': expected a finite float32, got inf",
           scale_value=float("inf"))
    _fails(SFA, fwd_feeds(), "SA-S8", "got 1e+40", scale_value=1e40)  # overflows float32
    with pytest.warns(GeirWarning, match=r"\[SF-W1\] .*attribute 'pre_tokens': expected 9223372036854775807 "
                                         r"\(INT64_MAX\), got 5; ignored"):
        sfa_graph(fwd_feeds(), SFA, scale_value=0.5, pre_tokens=5)


def test_zero_dims_sinks_and_stats_rules():
    _fails(SFA, fwd_feeds(K=0), "SA-S9", "input 3 'sparse_indices' dim 3: expected a non-zero extent, got 0")
    _fails(SFA_GRAD, grad_feeds(S2=0), "SA-S9", "input 1 'key' dim 1")
    _fails(SFA, fwd_feeds(sinks=z(3, dtype=np.float32)), "SF-S11", "input 9 'sinks': expected shape (4,) (N1), got [3]")
    _fails(SFA_GRAD, grad_feeds(softmax_max=z(1, 4, 1, 4, dtype=np.float32)), "SG-S10",
           "input 5 'softmax_max': expected shape [1, 1, 4, 4]", "got [1, 4, 1, 4]")
    _fails(SFA_GRAD, grad_feeds(out=z(1, 4, 4, 6)), "SG-S11", "input 4 'out' dim 3: expected 8 (D2, dim 3 of input 3 "
           "'d_out')")
    _fails(SFA_GRAD, grad_feeds(value=z(1, 8, 1, 6)), "SG-S11", "input 7 'value' dim 3: expected 8 (D2")


def test_dtype_rules():
    f = fwd_feeds()
    f["key"] = f["key"].astype(np.float32)
    with pytest.raises(GraphError, match=r"\[SCH-5\] .*input 1 'key': expected dtype in \{float16, bfloat16\}"):
        sfa_graph(f, SFA, scale_value=0.5)
    import ml_dtypes
    f = fwd_feeds()
    f["value"] = f["value"].astype(ml_dtypes.bfloat16)
    with pytest.raises(GraphError, match=r"\[SCH-6\] .*got \(float16, float16, bfloat16, int32\)"):
        sfa_graph(f, SFA, scale_value=0.5)


def test_cann_grad_error_uts():
    """The grad error UTs of spec 4.10, each with its rule."""
    base = dict(S1=64, S2=128, N1=8, D=128, D2=128, K=4)
    _fails(SFA_GRAD, grad_feeds(**base), "SA-S1", layout="BSH", sparse_block_size=64)
    _fails(SFA_GRAD, grad_feeds(**base), "SA-S8", sparse_mode=2)
    _fails(SFA_GRAD, grad_feeds(**dict(base, D2=256)), "SA-S5", "expected <= D = 128")
    tnd = grad_feeds("TND", T1=64, T2=128, N1=8, D=128, D2=128, K=4)
    del tnd["actual_seq_lengths_query"], tnd["actual_seq_lengths_kv"]
    _fails(SFA_GRAD, tnd, "SA-S7", layout="TND")
    _fails(SFA_GRAD, grad_feeds(**base), "SA-S2", layout="TND")
    ok, _ = sfa_graph(grad_feeds(**base), SFA_GRAD, scale_value=0.088, sparse_block_size=64)
    report = geir.check(ok, "ascend910b")
    assert {"SA-T5", "SG-T8"} <= report.rules()  # D = 128 and K = 4: valid IR, rejected by devices
    two_heads, _ = sfa_graph(grad_feeds(**dict(base, N2=2)), SFA_GRAD, scale_value=0.088)
    assert "SA-T3" in geir.check(two_heads, "ascend950").rules()
    six_heads, _ = sfa_graph(grad_feeds(**dict(base, N1=6)), SFA_GRAD, scale_value=0.088)
    assert "SA-T4" in geir.check(six_heads, "ascend910b").rules()
    assert "SA-T4" not in geir.check(six_heads, "ascend950").rules()   # 6 is in the 950 grad set


def _device_forward(**overrides):
    feeds = fwd_feeds("TND", T1=16, T2=2048, N1=16, D=512, D2=512, K=2048, Dr=64)
    attrs = dict(scale_value=1 / 24, layout_query="TND", layout_kv="TND", attention_mode=2, sparse_mode=0)
    attrs.update(overrides)
    return sfa_graph(feeds, SFA, **attrs)[0]


def test_forward_target_rules():
    g = _device_forward()
    for target in ("ascend910b", "ascend910_93", "ascend950"):
        assert geir.check(g, target).ok, geir.check(g, target)
    assert geir.check(_device_forward(attention_mode=0), "ascend950").rules() == {"SF-T1"}
    assert geir.check(_device_forward(sparse_block_size=4), "ascend950").rules() == {"SA-T7"}
    assert geir.check(_device_forward(sparse_block_size=4), "ascend910b").ok
    assert geir.check(_device_forward(sparse_block_size=3), "ascend910b").rules() == {"SA-T7"}
    with pytest.warns(GeirWarning, match="SF-W1"):
        bounded = _device_forward(next_tokens=10)
    assert geir.check(bounded, "ascend910_93").rules() == {"SF-T9"}
    no_rope = sfa_graph(fwd_feeds("TND", T1=16, T2=2048, N1=16, D=512, D2=512, K=2048), SFA, scale_value=0.1,
                        layout_query="TND", layout_kv="TND", attention_mode=2)[0]
    assert geir.check(no_rope, "ascend950").rules() == {"SF-T2"}
    sinks = sfa_graph(fwd_feeds("TND", T1=16, T2=2048, N1=16, D=512, D2=512, K=2048, Dr=64,
                                sinks=z(16, dtype=np.float32)), SFA, scale_value=0.1, layout_query="TND",
                      layout_kv="TND", attention_mode=2)[0]
    assert geir.check(sinks, "ascend910b").rules() == {"SF-T10"} and geir.check(sinks, "ascend950").ok
    odd = sfa_graph(fwd_feeds("TND", T1=16, T2=2048, N1=12, D=512, D2=512, K=2048, Dr=64), SFA, scale_value=0.1,
                    layout_query="TND", layout_kv="TND", attention_mode=2)[0]
    report = geir.check(odd, "ascend910b")
    assert report.rules() == {"SA-T4"} and "expected N1 in {1, 2, 4, ..., 128}, got 12" in str(report)
    assert geir.check(odd, "ascend950").ok


def test_grad_target_rules():
    feeds = grad_feeds("TND", T1=16, T2=2048, N1=16, D=512, D2=512, K=2048, Dr=64)
    g = sfa_graph(feeds, SFA_GRAD, scale_value=0.044194, layout="TND", sparse_mode=0)[0]
    for target in ("ascend910b", "ascend910_93", "ascend950"):
        assert geir.check(g, target).ok, geir.check(g, target)
    merged = sfa_graph(dict(feeds, value=None), SFA_GRAD, scale_value=0.044, layout="TND", sparse_mode=0)[0]
    assert geir.check(merged, "ascend950").rules() == {"SG-T11"} and geir.check(merged, "ascend910b").ok
    # value_is_key: SG-T13 (issue 27) reports a value that is not key's tensor; these cases isolate other rules
    rope32 = grad_feeds("TND", T1=16, T2=2048, N1=16, D=512, D2=512, K=2048, Dr=32)
    assert geir.check(sfa_graph(rope32, SFA_GRAD, scale_value=0.1, layout="TND", value_is_key=True)[0],
                      "ascend950").rules() == {"SG-T6"}
    k1000 = grad_feeds("TND", T1=16, T2=2048, N1=16, D=512, D2=512, K=1000, Dr=64)
    assert geir.check(sfa_graph(k1000, SFA_GRAD, scale_value=0.1, layout="TND", value_is_key=True)[0],
                      "ascend950").rules() == {"SG-T8"}
    big_b = grad_feeds("BSND", B=257, S1=1, S2=8, N1=16, D=512, D2=512, K=1024, Dr=64)
    report = geir.check(sfa_graph(big_b, SFA_GRAD, scale_value=0.1, value_is_key=True)[0], "ascend910b")
    assert report.rules() == {"SG-T12"} and "expected B <= 256, got 257" in str(report)
    wide = grad_feeds("TND", T1=2, T2=2048, N1=16, D=512, D2=512, K=8192, Dr=64)
    with pytest.warns(GeirWarning, match=r"\[SG-W2\] .* on ascend950: .*expected K \* sparse_block_size <= 100000, "
                                         r"got 8192 \* 16 = 131072"):
        report = geir.check(sfa_graph(wide, SFA_GRAD, scale_value=0.1, layout="TND", sparse_block_size=16,
                                      value_is_key=True)[0], "ascend950")
    assert "SG-W2" not in report.rules() and [w.rule for w in report.warnings] == ["SG-W2"]
    assert "warning (doc): [SG-W2]" in str(report)
