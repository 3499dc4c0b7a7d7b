"""What the MoE family's tests share: the op names, one-node graph builders, the unpermute exporters write (a Gather
and a weighted sum: what geir.fuse turns into the op) and the graph the VJP tests differentiate."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from helpers import ints

bf16_tokens_f32_probs_expected = pytest.mark.filterwarnings(r"ignore:\[MG-W2\]:geir.GeirWarning")
"""For tests that build the grad with bfloat16 tokens and float32 probs on purpose: a legal pair whose device kernel
returns NaN (MG-W2, issue 27, item 3; tests/moe/test_moe_upstream_rules.py tests the warning itself)."""

MOE, MOE_GRAD = "MoeTokenUnpermute", "MoeTokenUnpermuteGrad"


def moe_graph(rows, hidden, slots, probs_shape=None, dtype="float32", probs_dtype=None, name="node", **attrs):
    """One MoeTokenUnpermute node: inputs tokens, indices[, probs]; output y."""
    b = geir.GraphBuilder("moe")
    tokens = b.input("tokens", dtype, (rows, hidden))
    indices = b.input("indices", "int32", (slots,))
    probs = b.input("probs", probs_dtype or dtype, probs_shape) if probs_shape is not None else None
    b.output(b.MoeTokenUnpermute(tokens, indices, probs, name=name, **attrs), "y")
    return b.build()


def moe_grad_graph(tokens_shape, grad_shape, slots, probs_shape=None, dtype="float32", probs_dtype=None,
                   name="node", index_dtype="int32", **attrs):
    """One MoeTokenUnpermuteGrad node: inputs [tokens,] dy, indices[, probs]; outputs ptg, pg."""
    b = geir.GraphBuilder("moe_grad")
    tokens = b.input("tokens", dtype, tokens_shape) if tokens_shape is not None else None
    dy = b.input("dy", dtype, grad_shape)
    indices = b.input("indices", index_dtype, (slots,))
    probs = b.input("probs", probs_dtype or dtype, probs_shape) if probs_shape is not None else None
    ptg, pg = b.MoeTokenUnpermuteGrad(tokens, dy, indices, probs, name=name, **attrs)
    b.output(ptg, "ptg")
    b.output(pg, "pg")
    return b.build()


def unpermute_subgraph(probs: str | None = "unsqueeze", index_dtype="int32", tokens=3, topk=2, hidden=4,
                       indices=None):
    """The unpermute of standard ops: Gather of the permuted rows by idx (fed, or ``indices`` as a constant), Reshape,
    times probs (``probs``: "unsqueeze" or "reshape" for its shape, None for none), ReduceSum over topK; output y."""
    b = geir.GraphBuilder("moe")
    permuted = b.input("permuted", "float32", (tokens * topk, hidden))
    idx = b.constant("idx", np.asarray(indices, index_dtype)) if indices is not None else \
        b.input("idx", index_dtype, (tokens * topk,))
    rows = b.op("Reshape", b.op("Gather", permuted, idx, axis=0), ints(b, [tokens, topk, hidden]))
    if probs is not None:
        p = b.input("probs", "float32", (tokens, topk))
        shaped = b.op("Unsqueeze", p, ints(b, [-1])) if probs == "unsqueeze" else \
            b.op("Reshape", p, ints(b, [tokens, topk, 1]))
        rows = b.op("Mul", shaped, rows) if probs == "reshape" else b.op("Mul", rows, shaped)
    b.output(b.op("ReduceSum", rows, ints(b, [1]), keepdims=0), "y")
    return b.build()


def moe_vjp_graph(rows, slots, probs_shape, grad_op=False):
    """An unpermute to differentiate (hidden 4): the forward times itself (y), or the grad op with its ptg squared
    (ptg, pg); inputs tokens, indices[, probs][, dy]."""
    b = geir.GraphBuilder("moe")
    tokens = b.input("tokens", "float32", (rows, 4))
    indices = b.input("indices", "int32", (slots,))
    probs = b.input("probs", "float32", probs_shape) if probs_shape else None
    if grad_op:
        dy = b.input("dy", "float32", (probs_shape[0], 4))
        ptg, pg = b.MoeTokenUnpermuteGrad(tokens, dy, indices, probs)
        b.output(b.op("Mul", ptg, ptg), "ptg")
        b.output(pg, "pg")
    else:
        b.output(b.op("Mul", b.MoeTokenUnpermute(tokens, indices, probs), tokens if rows == 1 else
                      b.MoeTokenUnpermute(tokens, indices, probs)), "y")
    return b.build()
