"""VJPs of MoeTokenPermute and MoeTokenPermuteGrad: each is the other's transpose.

The forward copies token ``row2slot[r] // K`` to row r (r < R), so its VJP w.r.t. tokens sums, per token, the
cotangent rows of its K copies -- MoeTokenPermuteGrad(d_rows, sorted_indices, num_topk=K), read from the forward's
own ``sorted_indices`` output (``indices`` are ids: no cotangent). The grad op is linear in its gradient input, and
its transpose copies ``d_input_grad[row2slot[r] // K]`` to row r: a MoeTokenPermute of ``d_input_grad`` whose ids
are ``sorted_indices`` itself, shaped (T, K) (a stable sort of a permutation is its inverse, ``row2slot``, and the
sorted_indices it returns are the ids again), keeping ``min(R, M)`` rows (``num_out_tokens = R - M`` when R < M: the
negative form keeps R rows even when R is 0) and zero rows past M. Together with MoeTokenUnpermute(Grad)'s VJPs
(``schemas/moe/vjp.py``) a permute -> experts -> unpermute step differentiates into our ops alone.
"""

from __future__ import annotations

import numpy as np

from ...ir._errors import GraphError
from ..vjp import register_vjp
from .schema import FORWARD, GRAD


def _static(node, what: str, *dims) -> None:
    if not all(isinstance(d, int) for d in dims):
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': {what} must be static to differentiate, got "
                         f"{list(dims)}", node=node.name)


@register_vjp(FORWARD.op_type)
def _forward(ctx, node, grads):
    d_rows = grads[0]
    tokens, indices = node.inputs
    if d_rows is None or not ctx.needs(tokens) or not tokens.type.dtype.is_floating:
        return [None, None]
    topk = indices.type.shape[1] if len(indices.type.shape) == 2 else 1
    _static(node, "topK and the hidden dims", topk, *tokens.type.shape[1:])
    shape = tuple(tokens.type.shape)
    flat = d_rows
    if len(shape) != 2:
        flat = ctx.op("Reshape", d_rows, ctx.ints([-1, int(np.prod(shape[1:]))]), allowzero=0)
    d_tokens = ctx.b.MoeTokenPermuteGrad(flat, ctx.new(node.outputs[1]), num_topk=topk, name=ctx.fresh("permute_grad"))
    if len(shape) != 2:
        d_tokens = ctx.op("Reshape", d_tokens, ctx.ints([-1, *shape[1:]]), allowzero=0)
    return [d_tokens, None]


@register_vjp(GRAD.op_type)
def _grad(ctx, node, grads):
    d_input = grads[0]
    rows_grad, indices = node.inputs
    if d_input is None:
        return [None, None]
    topk = node.attributes["num_topk"]
    rows, slots = rows_grad.type.shape[0], indices.type.shape[0]
    if rows != slots:
        _static(node, "the rows of permuted_output_grad and len(sorted_indices)", rows, slots)
    keep = 0 if rows == slots or rows > slots else rows - slots
    ids = ctx.op("Reshape", ctx.new(indices), ctx.ints([-1, topk]), allowzero=0)
    d_rows, _ = ctx.b.MoeTokenPermute(d_input, ids, num_out_tokens=keep, name=ctx.fresh("permute"))
    if isinstance(rows, int) and isinstance(slots, int) and rows > slots:
        d_rows = ctx.op("Pad", d_rows, ctx.ints([0, 0, rows - slots, 0]))
    return [d_rows, None]
