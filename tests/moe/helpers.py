"""What the MoE family's tests share: the op names and one-node graph builders."""

from __future__ import annotations

import geir

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
