"""SparseFlashAttentionGrad on ONNX Runtime: CANN's grad UT shapes, where many query rows select the
same key blocks, give the NumPy runtime's result and the same bits on every run, through the native
kernel (the onnxruntime runtime) and through the exported model's function body on plain ONNX Runtime
(the body never scatters with duplicate targets)."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from oracles.onnx_runners import run_onnxruntime
from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase, sfa_grad_feeds, sfa_graph

# CANN's grad tiling UT shapes (D = 128, K = 4 or 8, bs 64, mode 3), and their rope / TND / KV-merge forms
UT_CASES = {
    "bsnd_f16": AttentionCase(B=1, S1=64, S2=128, N1=8, D=128, D2=128, K=4, bs=64, dtype="float16"),
    "bsnd_bf16": AttentionCase(B=2, S1=32, S2=64, N1=16, D=128, D2=128, K=8, bs=64, dtype="bfloat16", seed=1),
    "bsnd_rope_f16": AttentionCase(B=1, S1=64, S2=128, N1=8, D=128, D2=128, Dr=64, K=4, bs=64, dtype="float16", seed=2),
    "bsnd_rope_bf16": AttentionCase(B=1, S1=64, S2=128, N1=8, D=128, D2=128, Dr=64, K=4, bs=64, dtype="bfloat16",
                                    seed=3),
    "tnd_f16": AttentionCase(layout="TND", N1=8, D=128, D2=128, K=4, bs=64, tnd_q=[64], tnd_kv=[128], seed=4),
    "kv_merge_bf16": AttentionCase(B=1, S1=64, S2=128, N1=8, D=128, D2=128, K=4, bs=64, kv_merge=True, dtype="bfloat16",
                                   seed=5),
}
TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2}   # relative Frobenius error, spec 6.6


def _grad_problem(case: AttentionCase):
    arrays = case.arrays()
    # every row selects block 0 and (where causal mode lets it) block 1: duplicate key targets everywhere
    indices = arrays["sparse_indices"]
    indices[...] = -1
    indices[..., 0] = 0
    key_len = case.S2 if case.layout == "BSND" else case.tnd_kv[0]
    if key_len > case.bs:
        indices[..., 1] = 1
    forward_arrays = dict(arrays)
    if case.kv_merge:   # the forward of a KV-merged grad reads value = key[..., :D2]
        forward_arrays["value"] = np.ascontiguousarray(arrays["key"][..., :case.D2])
    fwd, fwd_feeds = sfa_graph(forward_arrays, SFA, **case.forward_attrs())
    out = geir.run(fwd, fwd_feeds)
    d_out = np.random.default_rng(case.seed + 100).standard_normal(out["attention_out"].shape)
    grad_feeds = sfa_grad_feeds(arrays, out, d_out.astype(arrays["query"].dtype), case.layout, indices)
    return sfa_graph(grad_feeds, SFA_GRAD, **case.grad_attrs())


@pytest.mark.parametrize("path", ["native kernel", "function body"])
@pytest.mark.parametrize("name", list(UT_CASES))
def test_grad_on_onnxruntime_is_deterministic_and_matches_numpy(name, path):
    case = UT_CASES[name]
    graph, feeds = _grad_problem(case)
    want = geir.run(graph, feeds)
    if path == "native kernel":
        runs, run = 20, lambda: geir.run(graph, feeds, runtime="onnxruntime")
    else:
        model = geir.to_onnx(graph)
        runs, run = 5, lambda: run_onnxruntime(model, feeds)
    first = run()
    for name_ in want:
        got, ref = first[name_].astype(np.float64), want[name_].astype(np.float64)
        error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        assert error <= TOLERANCE[case.dtype], (name_, error)
    for _ in range(runs - 1):
        again = run()
        for name_ in first:
            assert np.array_equal(again[name_].view(np.uint16), first[name_].view(np.uint16)), name_
