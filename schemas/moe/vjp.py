"""VJPs of the MoE ops (spec 3.3).

Forward -> MoeTokenUnpermuteGrad (with and without probs). The grad op needs permuted_tokens of M rows:
when the forward had R != M rows (dropped slots), the rows are zero-padded to M (a dropped slot then
reads zeros: its probs cotangent is 0, as the forward ignores it) and the result cut back to R rows.
The grad op is linear in its gradient input and bilinear in (permuted_tokens, gradient) and (gradient,
probs), and every cotangent is one of our ops again:
d dY = unpermute(d ptg, s, probs) + unpermute(P, s, d pg); d P = MoeTokenUnpermuteGrad(P, dY, s, d pg).ptg;
d probs = MoeTokenUnpermuteGrad(d ptg, dY, s, probs).pg.
"""

from __future__ import annotations

from ...ir._errors import GraphError
from ..vjp import register_vjp
from .schema import FORWARD, GRAD


def _rows_to(ctx, node, tokens, rows: int, want: int):
    """``tokens`` (rows, H) padded with zero rows or cut to ``want`` rows."""
    if rows == want:
        return tokens
    if rows > want:
        return ctx.op("Slice", tokens, ctx.ints([0]), ctx.ints([want]), ctx.ints([0]))
    return ctx.op("Pad", tokens, ctx.ints([0, 0, want - rows, 0]))


@register_vjp(FORWARD.op_type)
def _forward(ctx, node, grads):
    dy = grads[0]
    tokens, indices, probs = (ctx.new(v) for v in node.inputs)
    rows, slots = tokens.type.shape[0], indices.type.shape[0]
    if rows != slots and not (isinstance(rows, int) and isinstance(slots, int)):
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': permuted_tokens has {rows} rows and "
                         f"sorted_indices {slots} slots; differentiating needs them equal or both static",
                         node=node.name)
    padded = _rows_to(ctx, node, tokens, rows, slots) if probs is not None else None
    ptg, pg = ctx.b.MoeTokenUnpermuteGrad(padded, dy, indices, probs, name=ctx.fresh("moe_grad"))
    return [_rows_to(ctx, node, ptg, slots, rows), None, pg if probs is not None else None]


@register_vjp(GRAD.op_type)
def _grad(ctx, node, grads):
    d_ptg, d_pg = grads
    tokens, dy, indices, probs = (ctx.new(v) for v in node.inputs)
    if d_ptg is None:
        d_ptg = ctx.zeros_like(ctx.new(node.outputs[0]))
    terms = [ctx.b.MoeTokenUnpermute(d_ptg, indices, probs, name=ctx.fresh("moe_transpose"))]
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

