"""Vector-Jacobian products of the standard ONNX ops commonly found around ours in models.

Add, Sub, Mul, Div (broadcasting: the cotangent is summed over an operand's broadcast axes), Neg, MatMul
(rank >= 2), Transpose, Reshape, Squeeze, Unsqueeze, Flatten, Concat, Slice, Gather, Cast, Identity,
ReduceSum, Softmax, and the elementwise Exp, Log, Sqrt, Reciprocal, Tanh, Sigmoid, Relu, Abs. Index-like operands (shapes, axes, indices) get no cotangent. Scatters are never
used: Gather's and strided Slice's cotangents are one-hot matrix products, deterministic on every
runtime (ONNX Runtime's ScatterND with reduction races on repeated targets), with non-finite cotangents
placed by indicators so that a one-hot zero never meets them (``_one_hot_sum``).
"""

from __future__ import annotations

import numpy as np

from ..ir._errors import GraphError
from .onnx_slice import SliceError, slice_positions
from .vjp import register_vjp

STANDARD = ""


def _static(value, what: str, node) -> tuple[int, ...]:
    if not value.type.is_static:
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': the cotangent of {what} needs its static shape, "
                         f"got {list(value.type.shape)}", node=node.name)
    return tuple(value.type.shape)


def _constant_ints(ctx, value, what: str, node) -> list[int]:
    array = ctx.constant_of(value)
    if array is None:
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': {what} must be a constant of the graph to "
                         f"differentiate through it", node=node.name)
    return [int(v) for v in np.asarray(array).reshape(-1)]


@register_vjp("Add", STANDARD)
def _add(ctx, node, grads):
    g = grads[0]
    a, b = (ctx.new(v) for v in node.inputs)
    return [ctx.sum_to(g, a), ctx.sum_to(g, b)]


@register_vjp("Sub", STANDARD)
def _sub(ctx, node, grads):
    g = grads[0]
    a, b = (ctx.new(v) for v in node.inputs)
    return [ctx.sum_to(g, a), ctx.sum_to(ctx.op("Neg", g), b)]


@register_vjp("Mul", STANDARD)
def _mul(ctx, node, grads):
    g = grads[0]
    a, b = (ctx.new(v) for v in node.inputs)
    return [ctx.sum_to(ctx.op("Mul", g, b), a), ctx.sum_to(ctx.op("Mul", g, a), b)]


@register_vjp("Div", STANDARD)
def _div(ctx, node, grads):
    g = grads[0]
    a, b = (ctx.new(v) for v in node.inputs)
    y = ctx.new(node.outputs[0])
    da = ctx.op("Div", g, b)
    db = ctx.op("Neg", ctx.op("Mul", da, y))          # d(a / b)/db = -(a / b) / b
    return [ctx.sum_to(da, a), ctx.sum_to(db, b)]


@register_vjp("Neg", STANDARD)
def _neg(ctx, node, grads):
    return [ctx.op("Neg", grads[0])]


@register_vjp("Identity", STANDARD)
def _identity(ctx, node, grads):
    return [grads[0]]


@register_vjp("Cast", STANDARD)
def _cast(ctx, node, grads):
    source = node.inputs[0]
    if not source.type.dtype.is_floating:
        return [None]
    return [ctx.cast(grads[0], source.type)]


def _swap_last(ctx, value):
    rank = len(value.type.shape)
    return ctx.op("Transpose", value, perm=list(range(rank - 2)) + [rank - 1, rank - 2])


@register_vjp("MatMul", STANDARD)
def _matmul(ctx, node, grads):
    g = grads[0]
    a, b = (ctx.new(v) for v in node.inputs)
    if len(a.type.shape) < 2 or len(b.type.shape) < 2:
        raise GraphError(f"geir.grad: MatMul '{node.name}': operands of rank 1 are not differentiated (reshape them "
                         f"to matrices)", node=node.name)
    return [ctx.sum_to(ctx.op("MatMul", g, _swap_last(ctx, b)), a), ctx.sum_to(ctx.op("MatMul", _swap_last(ctx, a), g), b)]


@register_vjp("Transpose", STANDARD)
def _transpose(ctx, node, grads):
    rank = len(node.inputs[0].type.shape)
    perm = list(node.attributes.get("perm", range(rank - 1, -1, -1)))
    if rank == 0:       # a 0-d Transpose is the identity (and ONNX cannot write an empty perm)
        return [grads[0]]
    inverse = [perm.index(i) for i in range(rank)]
    return [ctx.op("Transpose", grads[0], perm=inverse)]


def _reshape_back(ctx, node, grads):
    x = ctx.new(node.inputs[0])
    return [ctx.op("Reshape", grads[0], ctx.shape_of(x))] + [None] * (len(node.inputs) - 1)


for _op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten"):
    register_vjp(_op, STANDARD)(_reshape_back)


@register_vjp("Concat", STANDARD)
def _concat(ctx, node, grads):
    g = grads[0]
    rank = len(node.outputs[0].type.shape)
    axis = int(node.attributes["axis"]) % rank
    pieces, start = [], 0
    for value in node.inputs:
        size = value.type.shape[axis]
        if not isinstance(size, int):
            raise GraphError(f"geir.grad: Concat '{node.name}': input '{value.name}' has a symbolic size on the "
                             f"concatenated axis", node=node.name)
        pieces.append(ctx.op("Slice", g, ctx.ints([start]), ctx.ints([start + size]), ctx.ints([axis])))
        start += size
    return pieces


def _one_hot_sum(ctx, product, g):
    """``product(g)`` -- a MatMul of the cotangent ``g`` with a 0/1 matrix, which places (and sums) its entries --
    with IEEE addition's meaning for non-finite entries: the matrix's zeros never meet them (0 * inf is NaN, where
    an entry placed elsewhere adds nothing). The finite part is placed as it is; where an inf, -inf or NaN lands is
    placed by 0/1 indicators, and the sum there is NaN (a NaN, or infinities of both signs), else that infinity."""
    dtype = g.type.dtype.numpy
    wide = g if dtype in (np.float32, np.float64) else ctx.op("Cast", g, to=1)      # IsInf takes float and double
    nan, pos, neg = ctx.op("IsNaN", wide), ctx.op("IsInf", wide, detect_negative=0), ctx.op("IsInf", wide,
                                                                                            detect_positive=0)
    zero = ctx.const(np.array(0, dtype), "zero")
    special = ctx.op("Or", nan, ctx.op("Or", pos, neg))
    total = product(ctx.op("Where", special, zero, g))

    def lands(mask):
        return ctx.op("Greater", product(ctx.op("Cast", mask, to=g.type.dtype.onnx)), zero)
    any_nan, any_pos, any_neg = lands(nan), lands(pos), lands(neg)
    total = ctx.op("Where", any_neg, ctx.const(np.array(-np.inf, dtype), "minus_inf"), total)
    total = ctx.op("Where", any_pos, ctx.const(np.array(np.inf, dtype), "inf"), total)
    invalid = ctx.op("Or", any_nan, ctx.op("And", any_pos, any_neg))
    return ctx.op("Where", invalid, ctx.const(np.array(np.nan, dtype), "nan"), total)


def _place_along(ctx, g, axis: int, positions: list[int], size: int):
    """The cotangent of ``x`` taken at ``positions`` along ``axis`` (distinct): zeros elsewhere."""
    rank = len(g.type.shape)
    if positions == list(range(positions[0], positions[0] + len(positions))):   # contiguous: pad with zeros
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = positions[0], size - positions[-1] - 1
        return ctx.op("Pad", g, ctx.ints(pads))
    onehot = np.zeros((len(positions), size), g.type.dtype.numpy)
    onehot[np.arange(len(positions)), positions] = 1
    perm = [i for i in range(rank) if i != axis] + [axis]
    moved = ctx.op("Transpose", g, perm=perm)
    matrix = ctx.const(onehot, "onehot")
    placed = _one_hot_sum(ctx, lambda v: ctx.op("MatMul", v, matrix), moved)
    return ctx.op("Transpose", placed, perm=[perm.index(i) for i in range(rank)])


@register_vjp("Slice", STANDARD)
def _slice(ctx, node, grads):
    x = node.inputs[0]
    shape = _static(x, "its input", node)
    starts = _constant_ints(ctx, node.inputs[1], "starts", node)
    ends = _constant_ints(ctx, node.inputs[2], "ends", node)
    axes = _constant_ints(ctx, node.inputs[3], "axes", node) if len(node.inputs) > 3 and node.inputs[3] is not None \
        else None
    steps = _constant_ints(ctx, node.inputs[4], "steps", node) if len(node.inputs) > 4 and node.inputs[4] is not None \
        else None
    try:
        chosen = slice_positions(shape, starts, ends, axes, steps)      # ONNX's clamping, as the runtimes slice
    except SliceError as exc:
        raise GraphError(f"geir.grad: Slice '{node.name}': {exc} (input shape {list(shape)})", node=node.name) from None
    g = grads[0]
    for axis, positions in chosen.items():
        if len(positions) == 0:
            return [ctx.zeros_like(ctx.new(x))] + [None] * (len(node.inputs) - 1)
        read = list(positions)
        if positions.step < 0:      # the cotangent read back to front, then placed at ascending positions
            g = ctx.op("Slice", g, ctx.ints([-1]), ctx.ints([-(2 ** 62)]), ctx.ints([axis]), ctx.ints([-1]))
            read = read[::-1]
        g = _place_along(ctx, g, axis, read, shape[axis])
    return [g] + [None] * (len(node.inputs) - 1)


@register_vjp("Gather", STANDARD)
def _gather(ctx, node, grads):
    data, indices = node.inputs
    shape = _static(data, "its data", node)
    index_shape = _static(indices, "its indices", node)
    axis = int(node.attributes.get("axis", 0)) % len(shape)
    size = shape[axis]
    before, after = int(np.prod(shape[:axis])), int(np.prod(shape[axis + 1:]))
    count = int(np.prod(index_shape))
    idx = ctx.op("Reshape", ctx.new(indices), ctx.ints([count, 1]))
    idx = ctx.op("Cast", idx, to=7)
    wrapped = ctx.op("Where", ctx.op("Less", idx, ctx.ints([0])), ctx.op("Add", idx, ctx.ints([size])), idx)
    positions = ctx.const(np.arange(size, dtype=np.int64).reshape(1, size), "positions")
    dtype = node.outputs[0].type.dtype
    onehot = ctx.op("Cast", ctx.op("Equal", wrapped, positions), to=dtype.onnx)              # (count, size)
    g = ctx.op("Reshape", grads[0], ctx.ints([before, count, after]))
    spread = ctx.op("Transpose", onehot, perm=[1, 0])
    placed = _one_hot_sum(ctx, lambda v: ctx.op("MatMul", spread, v), g)                  # (before, size, after)
    return [ctx.op("Reshape", placed, ctx.ints(shape)), None]


@register_vjp("ReduceSum", STANDARD)
def _reduce_sum(ctx, node, grads):
    x = ctx.new(node.inputs[0])
    rank = len(x.type.shape)
    axes = _constant_ints(ctx, node.inputs[1], "axes", node) if len(node.inputs) > 1 and node.inputs[1] is not None \
        else []
    if not axes and node.attributes.get("noop_with_empty_axes", 0):
        return [grads[0]] + [None] * (len(node.inputs) - 1)
    axes = sorted(a % rank for a in axes) if axes else list(range(rank))
    g = grads[0]
    if not node.attributes.get("keepdims", 1):
        g = ctx.op("Unsqueeze", g, ctx.ints(axes))
    return [ctx.op("Expand", g, ctx.shape_of(x))] + [None] * (len(node.inputs) - 1)


@register_vjp("Softmax", STANDARD)
def _softmax(ctx, node, grads):
    g, y = grads[0], ctx.new(node.outputs[0])
    axis = int(node.attributes.get("axis", -1))
    inner = ctx.op("ReduceSum", ctx.op("Mul", g, y), ctx.ints([axis]), keepdims=1)
    return [ctx.op("Mul", y, ctx.op("Sub", g, inner))]


# -- elementwise functions: the cotangent times the derivative, written with the output where that is cheaper ---------
def _scalar(ctx, value, number: float):
    """A 0-d constant of ``value``'s dtype (broadcasts against any shape)."""
    return ctx.const(np.asarray(number, value.type.dtype.numpy), "scalar")


@register_vjp("Exp", STANDARD)
def _exp(ctx, node, grads):
    return [ctx.op("Mul", grads[0], ctx.new(node.outputs[0]))]                          # d exp(x) = exp(x)


@register_vjp("Log", STANDARD)
def _log(ctx, node, grads):
    return [ctx.op("Div", grads[0], ctx.new(node.inputs[0]))]                           # d log(x) = 1 / x


@register_vjp("Sqrt", STANDARD)
def _sqrt(ctx, node, grads):
    y = ctx.new(node.outputs[0])
    return [ctx.op("Div", grads[0], ctx.op("Mul", y, _scalar(ctx, y, 2.0)))]             # d sqrt(x) = 1 / (2 y)


@register_vjp("Reciprocal", STANDARD)
def _reciprocal(ctx, node, grads):
    y = ctx.new(node.outputs[0])
    return [ctx.op("Neg", ctx.op("Mul", grads[0], ctx.op("Mul", y, y)))]                # d (1/x) = -y^2


@register_vjp("Tanh", STANDARD)
def _tanh(ctx, node, grads):
    y = ctx.new(node.outputs[0])
    return [ctx.op("Mul", grads[0], ctx.op("Sub", _scalar(ctx, y, 1.0), ctx.op("Mul", y, y)))]   # 1 - y^2


@register_vjp("Sigmoid", STANDARD)
def _sigmoid(ctx, node, grads):
    y = ctx.new(node.outputs[0])
    return [ctx.op("Mul", grads[0], ctx.op("Mul", y, ctx.op("Sub", _scalar(ctx, y, 1.0), y)))]   # y (1 - y)


@register_vjp("Relu", STANDARD)
def _relu(ctx, node, grads):
    """The cotangent where x > 0, and 0 elsewhere (a Where, so a non-finite cotangent there stays out, as in torch)."""
    x = ctx.new(node.inputs[0])
    return [ctx.op("Where", ctx.op("Greater", x, _scalar(ctx, x, 0.0)), grads[0], _scalar(ctx, x, 0.0))]


@register_vjp("Abs", STANDARD)
def _abs(ctx, node, grads):
    return [ctx.op("Mul", grads[0], ctx.op("Sign", ctx.new(node.inputs[0])))]             # sign(x); 0 at 0
