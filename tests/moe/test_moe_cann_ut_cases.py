"""CANN's own parameter-check cases of the MoE unpermute ops, as a table: each case CANN's tiling accepts must build
and pass geir.check on the target of that UT; the cases CANN accepts that the contract refuses fail with its rule.

Sources (read, facts only; the yuanfang-chen/ops-transformer mirror):
``moe/moe_token_unpermute/tests/ut/op_host/test_moe_token_unpermute_tiling.cpp`` and
``moe/moe_token_unpermute_grad/tests/ut/op_host/test_moe_token_unpermute_grad_tiling.cpp`` (all accepted by CANN).
Shapes are given without data: building a graph allocates nothing, so CANN's sizes are used as they are.
"""

from __future__ import annotations

import warnings

import pytest

import geir

# test_moe_token_unpermute_tiling.cpp: every case passes two inputs (no probs), so topK = 1 (its "prob_not_none"
# cases too: the UT declares an output shape that the tiling never checks; geir infers (rows, H)).
MOE_CASES = [("test_tiling_prob_none_bf16", 6144, 20480, "bfloat16"), ("test_tiling_prob_none_fp16", 6144, 5120, "float16"),
             ("test_tiling_prob_none_fp32", 6144, 5120, "float32"),
             *[(f"test_tiling_prob_not_none_{suffix}", 49152, 5120, dtype) for suffix, dtype in
               (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"), ("mix_bf16_fp32", "bfloat16"),
                ("mix_fp16_bf16", "float16"), ("mix_fp32_bf16", "float32"))]]


@pytest.mark.parametrize("case, rows, hidden, dtype", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_moe_token_unpermute_tiling_cases_are_accepted(case, rows, hidden, dtype):
    b = geir.GraphBuilder("cann_ut_moe")
    tokens, indices = b.input("permuted_tokens", dtype, (rows, hidden)), b.input("sorted_indices", "int32", (rows,))
    b.output(b.MoeTokenUnpermute(tokens, indices), "y")
    graph = b.build()
    assert graph.outputs[0].shape == (rows, hidden)
    report = geir.check(graph, "ascend910b")
    assert report.ok and not report.violations, str(report)


# test_moe_token_unpermute_grad_tiling.cpp, cases with probs: tokens (30, H), dY (10, H), 30 indices, probs (10, 3).
MOE_GRAD_CASES = [(f"test_tiling_prob_not_none_{name}", hidden, tokens, probs) for name, hidden, tokens, probs in (
    ("bf16_001", 64, "bfloat16", "bfloat16"), ("bf16_002", 64, "bfloat16", "float32"),
    ("split_h_bf16_001", 8192, "bfloat16", "bfloat16"), ("fp16_001", 64, "float16", "float16"),
    ("split_h_fp16_001", 8192, "float16", "float16"), ("split_h_fp16_002", 8192, "float16", "float32"),
    ("fp32_001", 64, "float32", "float32"), ("split_h_fp32_001", 8192, "float32", "float32"),
    ("split_h_fp32_002", 8192, "float32", "bfloat16"))]


def _moe_grad(hidden: int, tokens_dtype: str, probs_dtype: str | None, slots: int = 30) -> geir.Graph:
    b = geir.GraphBuilder("cann_ut_moe_grad")
    tokens = b.input("permuted_tokens", tokens_dtype, (slots, hidden))
    grad = b.input("unpermuted_tokens_grad", tokens_dtype, (10, hidden))
    indices = b.input("sorted_indices", "int32", (slots,))
    probs = None if probs_dtype is None else b.input("probs", probs_dtype, (10, 3))
    ptg, pg = b.MoeTokenUnpermuteGrad(tokens, grad, indices, probs)
    b.output(ptg, "permuted_tokens_grad")
    if pg is not None:
        b.output(pg, "probs_grad")
    return b.build()


@pytest.mark.parametrize("case, hidden, tokens_dtype, probs_dtype", MOE_GRAD_CASES, ids=[c[0] for c in MOE_GRAD_CASES])
def test_moe_token_unpermute_grad_tiling_cases_are_accepted(case, hidden, tokens_dtype, probs_dtype):
    nan_pair = tokens_dtype == "bfloat16" and probs_dtype == "float32"   # accepted, but NaN on the device (MG-W2)
    with warnings.catch_warnings():
        if nan_pair:
            warnings.filterwarnings("ignore", r"\[MG-W2\]", geir.GeirWarning)
        report = geir.check(_moe_grad(hidden, tokens_dtype, probs_dtype), "ascend910b")
    assert report.ok and not report.violations, str(report)
    assert [w.rule for w in report.warnings] == (["MG-W2"] if nan_pair else [])


@pytest.mark.parametrize("case", ["test_tiling_prob_none_bf16_001", "test_tiling_prob_none_fp16_001",
                                  "test_tiling_prob_none_fp32_001"])
def test_the_contract_refuses_what_canns_grad_tiling_accepts_without_probs(case):
    """Without probs CANN's tiling takes 30 indices for 10 tokens (topK 1, its tiling data says); the contract's
    MG-S2 needs M == Tn * K: which 10 of the 30 rows would receive dY is not defined, so geir refuses it."""
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[case.split("_")[4]]
    with pytest.raises(geir.GraphError, match=r"\[MG-S2\] .*expected tokens \* topK = 10 \* 1 = 10"):
        _moe_grad(64, dtype, None)
    assert geir.check(_moe_grad(64, dtype, None, slots=10), "ascend910b").ok       # with M = Tn it is accepted
