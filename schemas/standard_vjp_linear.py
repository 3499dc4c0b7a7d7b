"""Vector-Jacobian products of Gemm and Einsum (MatMul is with the arithmetic in ``standard_vjp``).

Einsum's cotangent of operand i is itself an Einsum: the output's cotangent contracted with the other operands to
operand i's subscripts; a subscript only operand i has (summed away in the forward) is broadcast back with Expand.
An ellipsis is given letters of its own. A subscript repeated within one operand (a diagonal, ``ii->i``) gives that
operand a cotangent on its diagonal only: each repeat is renamed to a fresh letter tied to the first by an identity
matrix in the cotangent's Einsum (the dim must be static). An operand broadcast from size 1 is refused with a
GraphError.
"""

from __future__ import annotations

import string

import numpy as np

from ..ir._errors import GraphError
from .standard_vjp import STANDARD, optional_input, scalar
from .vjp import register_vjp


@register_vjp("Gemm", STANDARD)
def _gemm(ctx, node, grads):
    """Y = alpha A' B' + beta C with A' = A or A^T (transA), B' likewise: dA' = alpha g B'^T, dB' = alpha A'^T g,
    dC = beta g summed to C's shape."""
    g = grads[0]
    a, b = ctx.new(node.inputs[0]), ctx.new(node.inputs[1])
    c = ctx.new(optional_input(node, 2))
    alpha, beta = float(node.attributes.get("alpha", 1.0)), float(node.attributes.get("beta", 1.0))
    trans_a, trans_b = int(node.attributes.get("transA", 0)), int(node.attributes.get("transB", 0))
    scaled = g if alpha == 1.0 else ctx.op("Mul", g, scalar(ctx, g, alpha))
    a_used = ctx.op("Transpose", a, perm=[1, 0]) if trans_a else a
    b_used = ctx.op("Transpose", b, perm=[1, 0]) if trans_b else b
    result: list = [None, None, None][:len(node.inputs)]
    if ctx.needs(node.inputs[0]):
        da = ctx.op("MatMul", scaled, ctx.op("Transpose", b_used, perm=[1, 0]))
        result[0] = ctx.op("Transpose", da, perm=[1, 0]) if trans_a else da
    if ctx.needs(node.inputs[1]):
        db = ctx.op("MatMul", ctx.op("Transpose", a_used, perm=[1, 0]), scaled)
        result[1] = ctx.op("Transpose", db, perm=[1, 0]) if trans_b else db
    if c is not None and ctx.needs(node.inputs[2]):
        dc = g if beta == 1.0 else ctx.op("Mul", g, scalar(ctx, g, beta))
        result[2] = ctx.sum_to(dc, c)
    return result


def _einsum_terms(node) -> tuple[list[str], str]:
    """The node's operand subscripts and output subscripts, each ellipsis replaced by letters of its own (right-
    aligned: an operand with fewer ellipsis dims takes the last ones), the implicit output made explicit."""
    equation = str(node.attributes["equation"]).replace(" ", "")
    left, arrow, right = equation.partition("->")
    terms = left.split(",")
    if len(terms) != len(node.inputs):
        raise GraphError(f"geir.grad: Einsum '{node.name}': equation {equation!r} has {len(terms)} operands, the node "
                         f"{len(node.inputs)}", node=node.name)
    spare = [ch for ch in string.ascii_letters if ch not in equation]
    spans = [len(v.type.shape) - (len(t) - 3) for t, v in zip(terms, node.inputs) if "..." in t]
    width = max(spans, default=0)
    ellipsis = "".join(spare[:width])

    def expand(term: str, span: int) -> str:
        return term.replace("...", ellipsis[width - span:]) if "..." in term else term

    terms = [expand(t, len(v.type.shape) - (len(t) - 3)) for t, v in zip(terms, node.inputs)]
    if arrow:
        output = expand(right, width)
    else:                               # implicit: the ellipsis, then the subscripts used once, in alphabetical order
        letters = "".join(terms)
        output = ellipsis + "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1 and ch not in ellipsis))
    return terms, output


def _diagonal(ctx, node, term: str, value, spare: list[str], dtype) -> tuple[str, list[str], list]:
    """``term`` with each repeated subscript renamed to a fresh letter (taken from ``spare``), and the identity
    matrices (subscripts, values) that tie each fresh letter to the first: the cotangent lands on the diagonal."""
    seen: set[str] = set()
    renamed, ties, eyes = [], [], []
    for ch, dim in zip(term, value.type.shape):
        if ch not in seen:
            seen.add(ch)
            renamed.append(ch)
            continue
        if not isinstance(dim, int):
            raise GraphError(f"geir.grad: Einsum '{node.name}': the diagonal along subscript '{ch}' needs a static "
                             f"size, got {dim}", node=node.name)
        fresh = spare.pop(0)
        renamed.append(fresh)
        ties.append(ch + fresh)
        eyes.append(ctx.const(np.eye(dim, dtype=dtype), "diagonal"))
    return "".join(renamed), ties, eyes


@register_vjp("Einsum", STANDARD)
def _einsum(ctx, node, grads):
    g = grads[0]
    terms, output = _einsum_terms(node)
    out_shape = dict(zip(output, node.outputs[0].type.shape))
    operands = [ctx.new(v) for v in node.inputs]
    result = []
    for i, (term, value) in enumerate(zip(terms, node.inputs)):
        if not ctx.needs(value):
            result.append(None)
            continue
        for letter, dim in zip(term, value.type.shape):
            wanted = out_shape.get(letter)
            if isinstance(dim, int) and isinstance(wanted, int) and dim != wanted:
                raise GraphError(f"geir.grad: Einsum '{node.name}': operand {i} is broadcast along subscript "
                                 f"'{letter}' (size {dim} to {wanted}); give it the full size", node=node.name)
        spare = [ch for ch in string.ascii_letters if ch not in "".join(terms) + output]
        term, ties, eyes = _diagonal(ctx, node, term, value, spare, g.type.dtype.numpy)
        others = [t for j, t in enumerate(terms) if j != i] + ties
        reachable = set(output).union(*others) if others else set(output)
        kept = "".join(ch for ch in term if ch in reachable)
        equation = ",".join([output] + others) + "->" + kept
        d = ctx.op("Einsum", g, *(o for j, o in enumerate(operands) if j != i), *eyes, equation=equation)
        missing = [k for k, ch in enumerate(term) if ch not in reachable]
        if missing:                 # summed away by operand i alone: every position of it gets the same cotangent
            d = ctx.op("Expand", ctx.op("Unsqueeze", d, ctx.ints(missing)), ctx.shape_of(operands[i]))
        result.append(d)
    return result
