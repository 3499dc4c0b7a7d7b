"""VJPs of the MoE ops (spec 3.3).

Forward -> MoeTokenUnpermuteGrad (with and without probs). The grad op needs permuted_tokens of M rows:
when the forward had R != M rows (dropped slots), the rows are zero-padded to M (a dropped slot then
reads zeros: its probs cotangent is 0, as the forward ignores it) and the result cut back to R rows.
The grad op is linear in its gradient input and bilinear in (permuted_tokens, gradient) and (gradient,
probs), and every cotangent is one of our ops again:
d dY = unpermute(d ptg, s, probs) + unpermute(P, s, d pg); d P = MoeTokenUnpermuteGrad(P, dY, s, d pg).ptg;
d probs = MoeTokenUnpermuteGrad(d ptg, dY, s, probs).pg.

One form per op: ONNX export writes one function body per op and set of optional inputs, and the VJPs of nodes
with probs write MoE nodes with probs. So when the forward mixes MoE nodes with and without probs, every MoE node of
the derivative is written with them, the forward's copies too: probs of ones (x * 1 == x, exactly) and, for the
grad, zero tokens (its probs_grad, zeros by definition without probs, is then the constant it is). Without probs
anywhere, a grad the VJPs write takes zero tokens when the forward's grads take tokens (unread without probs).
"""

from __future__ import annotations

import numpy as np

from ...ir._errors import GraphError
from ..vjp import register_vjp
from .schema import FORWARD, GRAD


def _probs_of(node):
    index = 2 if node.op_type == FORWARD.op_type else 3
    return node.inputs[index] if len(node.inputs) > index else None


def _forms(ctx) -> tuple[bool, bool]:
    """(every MoE node written with probs, grads without probs take tokens), from the forward's MoE nodes; once."""
    key = "moe_forms"
    if key not in ctx.memo:
        nodes = [n for n in ctx.forward.nodes if n.domain == FORWARD.domain and n.op_type in (FORWARD.op_type,
                                                                                               GRAD.op_type)]
        with_probs = {_probs_of(n) is not None for n in nodes}
        tokens = any(n.op_type == GRAD.op_type and n.inputs[0] is not None for n in nodes)
        ctx.memo[key] = (with_probs == {True, False}, tokens)
    return ctx.memo[key]


def _filled(ctx, like, shape, value: float):
    """A constant of ``value`` in ``like``'s dtype: the ones of probs, the zeros of tokens."""
    if not all(isinstance(d, int) for d in shape):
        raise GraphError(f"geir.grad: the MoE nodes of this graph are written in one form (with probs), which needs "
                         f"static shapes; got a symbolic shape {list(shape)}")
    return ctx.const(np.full(shape, value, like.type.dtype.numpy), "moe_fill")


def _grad_without_probs(ctx, dy, indices, attributes=None, name=None, output_names=None):
    """MoeTokenUnpermuteGrad(tokens, dy, indices) without probs, in the derivative's form (see the module doc)."""
    full, with_tokens = _forms(ctx)
    tokens = _filled(ctx, dy, (indices.type.shape[0], dy.type.shape[1]), 0.0) if full or with_tokens else None
    probs = _filled(ctx, dy, (dy.type.shape[0], 1), 1.0) if full else None
    return ctx.b.add_node(GRAD, [tokens, dy, indices, probs], attributes, name=name or ctx.fresh("moe_grad"),
                          output_names=output_names)


def _unpermute_without_probs(ctx, tokens, indices, attributes=None, name=None, output_names=None):
    """MoeTokenUnpermute(tokens, indices) without probs, in the derivative's form."""
    probs = _filled(ctx, tokens, (indices.type.shape[0], 1), 1.0) if _forms(ctx)[0] else None
    return ctx.b.add_node(FORWARD, [tokens, indices, probs], attributes, name=name or ctx.fresh("moe_transpose"),
                          output_names=output_names)


def _names(node) -> list[str]:
    return [v.name if v is not None else "" for v in node.outputs]


def _rewrite_forward(ctx, node, inputs):
    """The forward's copy, with probs of ones when the derivative writes every MoE node with probs."""
    if inputs[2] is not None or not _forms(ctx)[0]:
        return None
    return _unpermute_without_probs(ctx, inputs[0], inputs[1], node.attributes, node.name, _names(node))


def _rewrite_grad(ctx, node, inputs):
    """The grad's copy in the derivative's form; its probs_grad (zeros without probs) a constant when read."""
    if inputs[3] is not None or not _forms(ctx)[0]:
        return None
    pg = node.outputs[1]
    read = pg is not None and (pg.uses or any(pg is v for v in ctx.forward.outputs))
    names = [node.outputs[0].name, pg.name if pg is not None and not read else ctx.fresh("moe_probs_grad")]
    ptg, made = _grad_without_probs(ctx, inputs[1], inputs[2], node.attributes, node.name, names)
    if read:
        made = ctx.b.constant(pg.name, np.zeros(pg.type.shape, pg.type.dtype.numpy))
    return (ptg, made)


def _rows_to(ctx, node, tokens, rows: int, want: int):
    """``tokens`` (rows, H) padded with zero rows or cut to ``want`` rows."""
    if rows == want:
        return tokens
    if rows > want:
        return ctx.op("Slice", tokens, ctx.ints([0]), ctx.ints([want]), ctx.ints([0]))
    return ctx.op("Pad", tokens, ctx.ints([0, 0, want - rows, 0]))


@register_vjp(FORWARD.op_type, rewrite=_rewrite_forward)
def _forward(ctx, node, grads):
    dy = grads[0]
    tokens, indices, probs = (ctx.new(v) for v in node.inputs)
    rows, slots = tokens.type.shape[0], indices.type.shape[0]
    if rows != slots and not (isinstance(rows, int) and isinstance(slots, int)):
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': permuted_tokens has {rows} rows and "
                         f"sorted_indices {slots} slots; differentiating needs them equal or both static",
                         node=node.name)
    if probs is None:
        ptg = _grad_without_probs(ctx, dy, indices)[0]
        return [_rows_to(ctx, node, ptg, slots, rows), None, None]
    padded = _rows_to(ctx, node, tokens, rows, slots)
    ptg, pg = ctx.b.MoeTokenUnpermuteGrad(padded, dy, indices, probs, name=ctx.fresh("moe_grad"))
    return [_rows_to(ctx, node, ptg, slots, rows), None, pg]


@register_vjp(GRAD.op_type, rewrite=_rewrite_grad)
def _grad(ctx, node, grads):
    d_ptg, d_pg = grads
    tokens, dy, indices, probs = (ctx.new(v) for v in node.inputs)
    if d_ptg is None:
        d_ptg = ctx.zeros_like(ctx.new(node.outputs[0]))
    terms = [ctx.b.MoeTokenUnpermute(d_ptg, indices, probs, name=ctx.fresh("moe_transpose")) if probs is not None
             else _unpermute_without_probs(ctx, d_ptg, indices)]
    d_tokens = d_probs = None
    if probs is not None and d_pg is not None:
        terms.append(ctx.b.MoeTokenUnpermute(tokens, indices, d_pg, name=ctx.fresh("moe_transpose")))
        d_tokens = ctx.b.MoeTokenUnpermuteGrad(tokens, dy, indices, d_pg, name=ctx.fresh("moe_grad"))[0]
    if probs is not None:
        d_probs = ctx.b.MoeTokenUnpermuteGrad(d_ptg, dy, indices, probs, name=ctx.fresh("moe_grad"))[1]
    d_dy = terms[0] if len(terms) == 1 else ctx.op("Add", *terms)
    if tokens is not None and d_tokens is None:
        d_tokens = ctx.zeros_like(tokens)
    return [d_tokens, d_dy, None, d_probs]

