"""Vector-Jacobian products of the standard reductions, Softmax, LogSoftmax and CumSum.

Every Reduce* op: ReduceSum, ReduceMean, ReduceSumSquare, ReduceL1, ReduceL2, ReduceLogSumExp, ReduceProd (exact
where the input holds zeros), ReduceMax and ReduceMin (tied maxima share the cotangent equally, as torch's amax
does). Axes are read where the node's opset keeps them: an attribute before ReduceSum-13 and the others' opset 18,
an input (a graph constant) since. Softmax and LogSoftmax before opset 13 normalise over every axis from ``axis`` on
(default 1), as those opsets define them.
"""

from __future__ import annotations

import numpy as np

from ..ir._errors import GraphError
from .standard_vjp import STANDARD, optional_constant_ints, scalar
from .vjp import register_vjp


def reduced_axes(ctx, node) -> list[int] | None:
    """The axes a Reduce* node reduces, sorted and non-negative; None where it reduces nothing (an empty axes
    input with noop_with_empty_axes)."""
    rank = len(node.inputs[0].type.shape)
    if "axes" in node.attributes:
        axes = [int(a) for a in node.attributes["axes"]]
    else:
        axes = optional_constant_ints(ctx, node, 1, "axes") or []
    if not axes and node.attributes.get("noop_with_empty_axes", 0):
        return None
    for axis in axes:
        if not -rank <= axis < max(rank, 1):
            raise GraphError(f"geir.grad: {node.op_type} '{node.name}': axis {axis} is out of range for rank {rank}",
                             node=node.name)
    return sorted({a % rank for a in axes}) if axes else list(range(rank))


def _kept(ctx, node, value, axes):
    """A reduction's output (or its cotangent) with the reduced axes kept as 1s, so it broadcasts against the input."""
    if node.attributes.get("keepdims", 1) or not axes:
        return value
    return ctx.op("Unsqueeze", value, ctx.ints(axes))


def _spread(ctx, node, g, axes):
    """The cotangent of the output, broadcast back to the input's shape."""
    return ctx.op("Expand", _kept(ctx, node, g, axes), ctx.shape_of(ctx.new(node.inputs[0])))


def _rest(node):
    return [None] * (len(node.inputs) - 1)


def _reduction(derivative):
    """A rule from ``derivative(ctx, x, y_kept, g_spread, axes)``, the input's cotangent of a Reduce* node."""
    def rule(ctx, node, grads):
        axes = reduced_axes(ctx, node)
        if axes is None:                       # nothing reduced: the op is the identity (or x^2, |x|, ...)
            axes = []
        x = ctx.new(node.inputs[0])
        y = _kept(ctx, node, ctx.new(node.outputs[0]), axes)
        return [derivative(ctx, x, y, _spread(ctx, node, grads[0], axes), axes)] + _rest(node)
    return rule


def reduced_count(ctx, x, axes):
    """How many elements each output of a reduction over ``axes`` sums, in x's dtype (a constant when static)."""
    if all(isinstance(x.type.shape[a], int) for a in axes):
        return scalar(ctx, x, float(np.prod([x.type.shape[a] for a in axes])))
    sizes = ctx.op("Gather", ctx.op("Shape", x), ctx.ints(axes))
    return ctx.op("Cast", ctx.op("ReduceProd", sizes, keepdims=0), to=x.type.dtype.onnx)


def _sum(ctx, x, y, g, axes):
    return g


def _mean(ctx, x, y, g, axes):
    return ctx.op("Div", g, reduced_count(ctx, x, axes)) if axes else g


def _sum_square(ctx, x, y, g, axes):
    return ctx.op("Mul", g, ctx.op("Mul", x, scalar(ctx, x, 2.0)))


def _l1(ctx, x, y, g, axes):
    return ctx.op("Mul", g, ctx.op("Sign", x))


def _l2(ctx, x, y, g, axes):
    """x / |x| times the cotangent, 0 where the norm is 0 (torch's choice)."""
    zero = scalar(ctx, x, 0.0)
    norm_zero = ctx.op("Equal", y, zero)
    safe = ctx.op("Where", norm_zero, scalar(ctx, x, 1.0), y)
    return ctx.op("Where", norm_zero, zero, ctx.op("Mul", g, ctx.op("Div", x, safe)))


def _log_sum_exp(ctx, x, y, g, axes):
    return ctx.op("Mul", g, ctx.op("Exp", ctx.op("Sub", x, y)))                           # softmax over the axes


def _extremum(ctx, x, y, g, axes):
    """Where x equals the reduced value, the cotangent shared by the ties."""
    hit = ctx.op("Equal", x, y)
    ties = ctx.op("ReduceSum", ctx.op("Cast", hit, to=x.type.dtype.onnx), ctx.ints(axes), keepdims=1) if axes \
        else ctx.op("Cast", hit, to=x.type.dtype.onnx)
    share = ctx.op("Div", g, ctx.op("Max", ties, scalar(ctx, x, 1.0)))
    return ctx.op("Where", hit, share, scalar(ctx, x, 0.0))


def _prod(ctx, x, y, g, axes):
    """The product of the other elements: y / x without a zero; with one zero, the product of the non-zeros at it
    and 0 elsewhere; with more, 0 everywhere."""
    if not axes:                                                        # nothing reduced: the identity
        return g
    zero, one = scalar(ctx, x, 0.0), scalar(ctx, x, 1.0)
    is_zero = ctx.op("Equal", x, zero)
    zeros = ctx.op("ReduceSum", ctx.op("Cast", is_zero, to=x.type.dtype.onnx), ctx.ints(axes), keepdims=1)
    nonzero_product = ctx.op("ReduceProd", ctx.op("Where", is_zero, one, x), ctx.ints(axes), keepdims=1)
    at_zero = ctx.op("Where", ctx.op("Equal", zeros, one), nonzero_product, zero)
    others = ctx.op("Where", is_zero, at_zero, ctx.op("Div", y, ctx.op("Where", is_zero, one, x)))
    return ctx.op("Mul", g, others)


for _op, _derivative in (("ReduceSum", _sum), ("ReduceMean", _mean), ("ReduceSumSquare", _sum_square),
                         ("ReduceL1", _l1), ("ReduceL2", _l2), ("ReduceLogSumExp", _log_sum_exp),
                         ("ReduceMax", _extremum), ("ReduceMin", _extremum), ("ReduceProd", _prod)):
    register_vjp(_op, STANDARD)(_reduction(_derivative))


def _softmax_axes(node) -> list[int]:
    """The axes Softmax or LogSoftmax normalises over: one since opset 13; before, every axis from ``axis`` on."""
    rank = len(node.inputs[0].type.shape)
    version = node.version or 13
    axis = int(node.attributes.get("axis", -1 if version >= 13 else 1)) % max(rank, 1)
    return [axis] if version >= 13 else list(range(axis, rank))


@register_vjp("Softmax", STANDARD)
def _softmax(ctx, node, grads):
    g, y = grads[0], ctx.new(node.outputs[0])
    inner = ctx.op("ReduceSum", ctx.op("Mul", g, y), ctx.ints(_softmax_axes(node)), keepdims=1)
    return [ctx.op("Mul", y, ctx.op("Sub", g, inner))]


@register_vjp("LogSoftmax", STANDARD)
def _log_softmax(ctx, node, grads):
    g, y = grads[0], ctx.new(node.outputs[0])
    total = ctx.op("ReduceSum", g, ctx.ints(_softmax_axes(node)), keepdims=1)
    return [ctx.op("Sub", g, ctx.op("Mul", ctx.op("Exp", y), total))]


@register_vjp("CumSum", STANDARD)
def _cumsum(ctx, node, grads):
    """A sum running the other way over the same axis (exclusive stays exclusive)."""
    reverse = 1 - int(node.attributes.get("reverse", 0))
    exclusive = int(node.attributes.get("exclusive", 0))
    return [ctx.op("CumSum", grads[0], ctx.new(node.inputs[1]), exclusive=exclusive, reverse=reverse), None]
