"""aclnnSparseFlashAttention(V2) and aclnnSparseFlashAttentionGrad: results equal geir.run of the same op (and the
float64 oracle), the null-pointer conventions (value, statistics, KV merge), sinks by device, paged caches strided
along their pages on ascend950, and the grad's empty-query return."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir import aclnn
from aclnn.helpers import failure, two_phase
from oracles.sfa import forward_reference
from sparse_attention.helpers import AttentionCase

FORWARD = (aclnn.aclnnSparseFlashAttentionGetWorkspaceSize, aclnn.aclnnSparseFlashAttention)
V2 = (aclnn.aclnnSparseFlashAttentionV2GetWorkspaceSize, aclnn.aclnnSparseFlashAttentionV2)
GRAD = (aclnn.aclnnSparseFlashAttentionGradGetWorkspaceSize, aclnn.aclnnSparseFlashAttentionGrad)
t = aclnn.aclCreateTensor


def _opt(array):
    return None if array is None else t(array)


def _forward_args(a, case, out, mx=None, sm=None, *, lse=True, value="given", attention_mode=0):
    value_tensor = {"given": _opt(a["value"]), "null": None}[value]
    return (t(a["query"]), t(a["key"]), value_tensor, t(a["sparse_indices"]), None,
            _opt(a["actual_seq_lengths_query"]), _opt(a["actual_seq_lengths_kv"]), _opt(a["query_rope"]),
            _opt(a["key_rope"]), case.scale, case.bs, case.layout, case.layout, case.mode, 2**63 - 1, 2**63 - 1,
            attention_mode, lse, t(out), _opt(mx), _opt(sm))


def _geir_forward(a, case, runtime):
    b = geir.GraphBuilder("sfa")
    feeds = {k: v for k, v in a.items() if v is not None}
    feeds.setdefault("value", a["key"])            # a KV merge case's forward reads the key as the value
    values = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items()}
    out = b.SparseFlashAttention(**values, **case.forward_attrs())
    for name, v in zip(("attention_out", "softmax_max", "softmax_sum"), out):
        b.output(v, name)
    return geir.run(b.build(), feeds, runtime=runtime)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_forward_equals_geir_run_and_the_oracle(runtime, layout):
    case = AttentionCase(layout=layout, Dr=4, N1=4, lengths=True, seed=1)
    a = case.arrays()
    ran = _geir_forward(a, case, runtime)
    out = np.zeros_like(ran["attention_out"])
    mx, sm = np.zeros_like(ran["softmax_max"]), np.zeros_like(ran["softmax_sum"])
    assert two_phase(*FORWARD, *_forward_args(a, case, out, mx, sm)) == 0
    for got, name in ((out, "attention_out"), (mx, "softmax_max"), (sm, "softmax_sum")):
        assert np.array_equal(got, ran[name]), name
    want = forward_reference(a["query"], a["key"], a["value"], a["sparse_indices"], scale=case.scale, layout=layout,
                             mode=case.mode, aq=a["actual_seq_lengths_query"], akv=a["actual_seq_lengths_kv"],
                             query_rope=a["query_rope"], key_rope=a["key_rope"], round_to=out.dtype)
    np.testing.assert_allclose(out.astype(np.float64), want[0], atol=5e-3, rtol=5e-3)


def test_a_null_value_reads_the_key(runtime):
    case = AttentionCase(D=8, D2=8, seed=2)
    a = case.arrays()
    a_key = dict(a, value=a["key"])
    null_out, key_out = (np.zeros((2, 5, 4, 8), np.float16) for _ in range(2))
    assert two_phase(*FORWARD, *_forward_args(a, case, null_out, lse=False, value="null")) == 0
    assert two_phase(*FORWARD, *_forward_args(a_key, case, key_out, lse=False)) == 0
    assert np.array_equal(null_out, key_out) and np.any(null_out != 0)


def test_statistics_outputs_follow_return_softmax_lse(runtime):
    """false: null statistics are fine (and given ones are not written); true: null ones are 161001."""
    case = AttentionCase(seed=3)
    a = case.arrays()
    out = np.zeros((2, 5, 4, 8), np.float16)
    untouched = np.full((2, 1, 5, 4), 9.0, np.float32)
    assert two_phase(*FORWARD, *_forward_args(a, case, out, untouched, None, lse=False)) == 0
    assert np.all(untouched == 9.0)
    assert two_phase(*FORWARD, *_forward_args(a, case, out, None, untouched, lse=True)) == 161001
    failure(161001, "softmaxMax", "returnSoftmaxLse")


def test_the_forward_refuses_an_empty_query_and_the_grad_returns_at_once(runtime):
    case = AttentionCase(seed=4)
    a = case.arrays()
    empty = dict(a, query=a["query"][:, :0], sparse_indices=a["sparse_indices"][:, :0])
    assert two_phase(*FORWARD, *_forward_args(empty, case, np.zeros((2, 0, 4, 8), np.float16), lse=False)) \
        == 561002
    failure(561002, "SA-S9")
    d_key = np.full_like(a["key"], 3.0)
    status = two_phase(*GRAD, t(empty["query"]), t(a["key"]), t(a["value"]), t(empty["sparse_indices"]),
                       t(np.zeros((2, 0, 4, 8), np.float16)), t(np.zeros((2, 0, 4, 8), np.float16)),
                       t(np.zeros((2, 1, 0, 4), np.float32)), t(np.zeros((2, 1, 0, 4), np.float32)), None, None,
                       None, None, case.scale, 1, "BSND", 3, 2**31 - 1, 2**31 - 1, False,
                       t(np.zeros((2, 0, 4, 8), np.float16)), t(d_key), t(np.zeros_like(a["value"])), None, None)
    assert status == 0 and np.all(d_key == 3.0)


@pytest.mark.parametrize("kv_merge", [False, True])
def test_grad_equals_geir_run(runtime, kv_merge):
    case = AttentionCase(Dr=4, kv_merge=kv_merge, seed=5)
    a = case.arrays()
    fwd = _geir_forward(a, case, runtime)
    d_out = np.random.default_rng(5).standard_normal(fwd["attention_out"].shape).astype(np.float16)
    b = geir.GraphBuilder("g")
    feeds = {"query": a["query"], "key": a["key"], "sparse_indices": a["sparse_indices"], "d_out": d_out,
             "out": fwd["attention_out"], "softmax_max": fwd["softmax_max"], "softmax_sum": fwd["softmax_sum"],
             "query_rope": a["query_rope"], "key_rope": a["key_rope"]}
    if not kv_merge:
        feeds["value"] = a["value"]
    values = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items()}
    grads = b.SparseFlashAttentionGrad(**values, **case.grad_attrs())
    names = ("d_query", "d_key", "d_value", "d_query_rope", "d_key_rope")
    for name, v in zip(names, grads):
        if v is not None:
            b.output(v, name)
    ran = geir.run(b.build(), feeds, runtime=runtime)
    outs = {name: np.full_like(ran[name], np.nan) for name in ran}
    status = two_phase(*GRAD, t(a["query"]), t(a["key"]), _opt(feeds.get("value")), t(a["sparse_indices"]),
                       t(d_out), t(fwd["attention_out"]), t(fwd["softmax_max"]), t(fwd["softmax_sum"]), None, None,
                       t(a["query_rope"]), t(a["key_rope"]), case.scale, case.bs, case.layout, case.mode,
                       2**31 - 1, 2**31 - 1, False, t(outs["d_query"]), t(outs["d_key"]),
                       _opt(outs.get("d_value")), t(outs["d_query_rope"]), t(outs["d_key_rope"]))
    assert status == 0
    for name in ran:
        assert np.array_equal(outs[name], ran[name]), name


def _device_case():
    """Shapes every device takes: D = D2 = 512, rope Dr = 64, one KV head, block size 1."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 2, 512)).astype(np.float16)
    k = rng.standard_normal((1, 32, 1, 512)).astype(np.float16)
    qr = rng.standard_normal((1, 2, 2, 64)).astype(np.float16)
    kr = rng.standard_normal((1, 32, 1, 64)).astype(np.float16)
    idx = np.stack([rng.permutation(32)[:4] for _ in range(2)]).astype(np.int32).reshape(1, 2, 1, 4)
    return q, k, qr, kr, idx


@pytest.mark.parametrize("target, status", [(None, 0), ("ascend950", 0), ("ascend910b", 361001),
                                            ("ascend910_93", 361001)])
def test_v2_sinks_run_on_ascend950_only(runtime, on_device, target, status):
    """CANN's op_api refuses sinks on Atlas A2/A3 (UT a3_sinks_not_supported): ACLNN_ERR_RUNTIME_ERROR."""
    on_device(target)
    q, k, qr, kr, idx = _device_case()
    sinks = np.zeros(2, np.float32)
    out = np.zeros((1, 2, 2, 512), np.float16)
    stats = [t(np.zeros((1, 1, 2, 2), np.float32)) for _ in range(2)]      # V2 needs them (never written here)
    got = two_phase(*V2, t(q), t(k), t(k), t(idx), None, None, None, t(qr), t(kr), t(sinks), 0.04, 1, "BSND", "BSND",
                    0, 2**63 - 1, 2**63 - 1, 2, False, t(out), *stats)
    assert got == status
    if status:
        failure(status, "sinks", target)
    else:
        assert np.any(out != 0)


def test_a_paged_cache_may_be_strided_along_its_pages_on_ascend950(runtime, on_device):
    """Doc (ascend950): key/value of PA_BSND take non-contiguous tensors along axis 0; elsewhere they are 161002."""
    q, k, qr, kr, idx = _device_case()
    page = 16
    pages = k.reshape(2, page, 1, 512)
    rope_pages = kr.reshape(2, page, 1, 64)
    storage = np.zeros((4, page, 1, 512), np.float16)
    storage[::2] = pages                                   # pages 0 and 2 of a 4-page pool
    view = t(storage, shape=[2, page, 1, 512], strides=[2 * page * 512, 512, 512, 1])
    table = np.array([[0, 1]], np.int32)
    lengths = np.array([32], np.int32)
    outs = []
    for target in ("ascend950", None):
        on_device(target)
        out = np.zeros((1, 2, 2, 512), np.float16)
        status = two_phase(*FORWARD, t(q), view, view, t(idx), t(table), None, t(lengths), t(qr), t(rope_pages),
                           0.04, 1, "BSND", "PA_BSND", 0, 2**63 - 1, 2**63 - 1, 2, False, t(out), None, None)
        outs.append((status, out))
    (status_950, out_950), (status_none, _) = outs
    assert status_950 == 0 and status_none == 161002
    failure(161002, "key", "contiguous")
    dense = np.zeros((1, 2, 2, 512), np.float16)
    assert two_phase(*FORWARD, t(q), t(k), t(k), t(idx), None, None, None, t(qr), t(kr), 0.04, 1, "BSND", "BSND",
                     0, 2**63 - 1, 2**63 - 1, 2, False, t(dense), None, None) == 0
    assert np.array_equal(out_950, dense)


def test_the_kv_merge_takes_no_d_value_output(runtime):
    """Grad doc: value null is the KV merge, which requires dValueOut null (dV is added into dKeyOut)."""
    case = AttentionCase(seed=7)
    a = case.arrays()
    args = [t(a["query"]), t(a["key"]), None, t(a["sparse_indices"]), t(np.zeros((2, 5, 4, 8), np.float16)),
            t(np.zeros((2, 5, 4, 8), np.float16)), t(np.zeros((2, 1, 5, 4), np.float32)),
            t(np.ones((2, 1, 5, 4), np.float32)), None, None, None, None, case.scale, 1, "BSND", 3, 2**31 - 1,
            2**31 - 1, False, t(np.zeros_like(a["query"])), t(np.zeros_like(a["key"]))]
    assert two_phase(*GRAD, *args, t(np.zeros_like(a["key"])), None, None) == 161002
    failure(161002, "dValueOut", "KV merge")
    args[2] = t(a["value"])
    assert two_phase(*GRAD, *args, None, None, None) == 161001
    failure(161001, "dValueOut")
