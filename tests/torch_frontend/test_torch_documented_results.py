"""``help()`` of geir.torch tells the truth (issue 30 item 7): npu_sparse_flash_attention and its positional form
return three tensors, the statistics float32 ``(0,)`` without return_softmax_lse (not None), as their help says; the
grad's absent rope gradients and the unpermute grads' absent probs gradient are the tensors their help names. Each
test runs the call (the public function and the registered op) and reads the help text, so they cannot drift."""

from __future__ import annotations

import pydoc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import geir.torch as gt  # noqa: E402

from sparse_attention.helpers import AttentionCase  # noqa: E402

_LENGTHS = ("actual_seq_lengths_query", "actual_seq_lengths_kv")


def _said(fn) -> str:
    """``help(fn)``'s text with line breaks and indentation as single spaces (a claim may wrap)."""
    return " ".join(pydoc.render_doc(fn, renderer=pydoc.plaintext).split())


def _tensors(case: AttentionCase, dtype=None) -> dict:
    out = {}
    for k, v in case.arrays().items():
        if v is not None:
            t = torch.from_numpy(np.ascontiguousarray(v).copy())
            out[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


@pytest.mark.parametrize("name", ["npu_sparse_flash_attention", "sparse_flash_attention"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("lse", [False, True])
def test_the_statistics_are_what_help_says(lse, layout, name):
    case = AttentionCase(layout=layout, N1=4, N2=2, seed=3)
    t = _tensors(case)
    lengths = {k: t[k] for k in _LENGTHS} if layout == "TND" else {}
    keywords = dict(**lengths, sparse_block_size=case.bs, layout_query=layout, layout_kv=layout,
                    sparse_mode=case.mode, return_softmax_lse=lse)
    fn = getattr(gt, name)
    g = case.N1 // case.N2
    rows = (case.B, case.N2, case.S1, g) if layout == "BSND" else (case.N2, t["query"].shape[0], g)
    for call in (fn, fn.op):                                   # the eager fast path and the registered op
        if name == "sparse_flash_attention":
            order = ("block_table", *_LENGTHS, "query_rope", "key_rope", "sparse_block_size", "layout_query",
                     "layout_kv", "sparse_mode", "pre_tokens", "next_tokens", "attention_mode", "return_softmax_lse")
            defaults = {"sparse_block_size": 1, "pre_tokens": 2**63 - 1, "next_tokens": 2**63 - 1,
                        "attention_mode": 0}
            positional = [keywords.get(k, t.get(k, defaults.get(k))) for k in order]
            results = call(t["query"], t["key"], t["value"], t["sparse_indices"], case.scale, *positional)
        else:
            results = call(t["query"], t["key"], t["value"], t["sparse_indices"], case.scale, **keywords)
        assert len(results) == 3 and all(isinstance(r, torch.Tensor) for r in results)
        assert results[0].shape == t["query"].shape and results[0].dtype == t["query"].dtype
        for stat in results[1:]:
            assert stat.dtype == torch.float32 and tuple(stat.shape) == (rows if lse else (0,))

    said = _said(fn)
    assert "Returns ``(attention_out, softmax_max, softmax_sum)``, always three tensors" in said
    assert "With ``return_softmax_lse=True`` the statistics are float32 ``(B, N2, S1, G)`` (BSND query) or " \
           "``(N2, T1, G)`` (TND)" in said
    assert "With ``return_softmax_lse=False`` (the default; a paged cache allows only False, PA-S5) each statistic " \
           "is an empty float32 tensor of shape ``(0,)``, not None" in said
    assert ("the arguments after scale_value by keyword" in said) == (name == "npu_sparse_flash_attention")


def test_float64_inputs_give_float64_statistics_as_help_says():
    case = AttentionCase(seed=4)
    t = _tensors(case, torch.float64)
    for lse in (False, True):
        _, row_max, row_sum = gt.npu_sparse_flash_attention(t["query"], t["key"], t["value"], t["sparse_indices"],
                                                            case.scale, sparse_mode=case.mode, return_softmax_lse=lse)
        assert row_max.dtype == row_sum.dtype == torch.float64 and (row_max.numel() == 0) == (not lse)
    said = _said(gt.npu_sparse_flash_attention)
    assert "float64 inputs (the kernels' gradcheck path) give float64 statistics" in said


def test_the_grads_absent_rope_gradients_are_what_help_says():
    case = AttentionCase(seed=5)
    t = _tensors(case)
    out, row_max, row_sum = gt.npu_sparse_flash_attention(t["query"], t["key"], t["value"], t["sparse_indices"],
                                                          case.scale, sparse_mode=case.mode, return_softmax_lse=True)
    grads = gt.npu_sparse_flash_attention_grad(t["query"], t["key"], t["value"], t["sparse_indices"], out, out,
                                               row_max, row_sum, case.scale, case.bs, sparse_mode=case.mode)
    assert len(grads) == 5 and all(isinstance(g, torch.Tensor) for g in grads)
    assert grads[3].shape == (0,) and grads[3].dtype == t["query"].dtype
    assert grads[4].shape == (0,) and grads[4].dtype == t["key"].dtype
    assert "without rope parts the last two are ``(0,)`` tensors of query's and key's dtype" in \
        _said(gt.npu_sparse_flash_attention_grad)


def test_the_unpermute_grads_without_probs_are_what_help_says():
    tokens = torch.randn(6, 8)
    slots = torch.arange(6, dtype=torch.int32).flip(0).contiguous()
    dy = torch.randn(6, 8)
    _, weights = gt.npu_moe_token_unpermute_grad(tokens, dy, slots)
    assert weights.shape == (6, 1) and weights.dtype == tokens.dtype and not weights.any()
    assert "without probs the second is the kernel's zeros of shape (tokens, 1)" in \
        _said(gt.npu_moe_token_unpermute_grad)
    _, weights = gt.npu_moe_token_unpermute_grad_v2(dy, slots, 6, tokens.dtype)
    assert weights.dim() == 0
    assert "without probs the second is a 0-d tensor" in _said(gt.npu_moe_token_unpermute_grad_v2)
