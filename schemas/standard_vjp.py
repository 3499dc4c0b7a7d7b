"""Vector-Jacobian products of the standard ONNX ops commonly found around ours in models.

Add, Sub, Mul, Div (broadcasting: the cotangent is summed over an operand's broadcast axes), Neg, MatMul
(rank >= 2), Transpose, Reshape, Squeeze, Unsqueeze, Flatten, Concat, Slice, Gather, Cast, Identity,
ReduceSum, Softmax; the helpers the other rule modules share. The elementwise functions are in
``standard_vjp_elementwise``, reductions and (log-)softmax in ``standard_vjp_reduce``, the ops that select, place
or repeat elements in ``standard_vjp_index``, normalizations and dropout in ``standard_vjp_norm``. Index-like
operands (shapes, axes, indices) get no cotangent; an op whose outputs are integers or booleans (comparisons,
Shape, ArgMax, NonZero) passes none on and needs no rule. Scatter-adds are never used: the cotangents of Gather,
GatherND, GatherElements, TopK and strided Slice are one-hot products, deterministic on every runtime (ONNX
Runtime's ScatterND with reduction races on repeated targets), with non-finite cotangents placed by indicators so
that a one-hot zero never meets them (``one_hot_sum``).
"""

from __future__ import annotations

import numpy as np

from ..ir._errors import GraphError
from .onnx_slice import SliceError, slice_positions
from .vjp import register_vjp

STANDARD = ""


def static_shape(value, what: str, node) -> tuple[int, ...]:
    if not value.type.is_static:
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': the cotangent of {what} needs its static shape, "
                         f"got {list(value.type.shape)}", node=node.name)
    return tuple(value.type.shape)


def constant_ints(ctx, value, what: str, node) -> list[int]:
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
    """Each input's part of the cotangent; where a size on the axis is a symbol, the bounds are computed from the
    shapes at run time."""
    g = grads[0]
    rank = len(node.outputs[0].type.shape)
    axis = int(node.attributes["axis"]) % rank
    pieces, start = [], 0
    for value in node.inputs:
        size = value.type.shape[axis]
        if isinstance(size, int) and isinstance(start, int):
            end = start + size
            bounds = ctx.ints([start]), ctx.ints([end])
        else:
            size_value = ctx.ints([size]) if isinstance(size, int) else dim_of(ctx, ctx.new(value), axis)
            first = ctx.ints([start]) if isinstance(start, int) else start
            end = ctx.op("Add", first, size_value)
            bounds = first, end
        pieces.append(ctx.op("Slice", g, *bounds, ctx.ints([axis])))
        start = end
    return pieces


def one_hot_sum(ctx, product, g):
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


def place_along(ctx, g, axis: int, sources: list[int], size: int):
    """The cotangent of ``x`` (of ``size`` along ``axis``) where output position o along ``axis`` read ``x`` at
    ``sources[o]`` (-1: read nothing, a padded value): zeros where nothing was read, sums where several were."""
    rank = len(g.type.shape)
    if sources and sources == list(range(sources[0], sources[0] + len(sources))):   # contiguous: pad with zeros
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = sources[0], size - sources[-1] - 1
        return ctx.op("Pad", g, ctx.ints(pads))
    onehot = np.zeros((len(sources), size), g.type.dtype.numpy)
    read = [(o, s) for o, s in enumerate(sources) if s >= 0]
    onehot[[o for o, _ in read], [s for _, s in read]] = 1
    perm = [i for i in range(rank) if i != axis] + [axis]
    moved = ctx.op("Transpose", g, perm=perm)
    matrix = ctx.const(onehot, "onehot")
    placed = one_hot_sum(ctx, lambda v: ctx.op("MatMul", v, matrix), moved)
    return ctx.op("Transpose", placed, perm=[perm.index(i) for i in range(rank)])


def optional_input(node, index: int):
    """A node's forward input ``index``, or None where it is absent (left out at the end, or given as "")."""
    return node.inputs[index] if len(node.inputs) > index else None


def optional_constant_ints(ctx, node, index: int, what: str) -> list[int] | None:
    """The integers of an optional input that must be a graph constant when given; None when absent."""
    value = optional_input(node, index)
    return None if value is None else constant_ints(ctx, value, what, node)


def _is_constant(ctx, node, index: int) -> bool:
    value = optional_input(node, index)
    return value is None or ctx.constant_of(value) is not None


@register_vjp("Slice", STANDARD)
def _slice(ctx, node, grads):
    """Constant bounds on static sliced axes: each read position placed (any step). Bounds computed in the graph or
    axes of symbolic size (exports with dynamic shapes): a unit-step slice is a window, and its cotangent is padded
    back by amounts computed from the shapes at run time with ONNX's clamping."""
    x = node.inputs[0]
    rank = len(x.type.shape)
    axes = optional_constant_ints(ctx, node, 3, "axes")
    steps = optional_constant_ints(ctx, node, 4, "steps")
    known = _is_constant(ctx, node, 1) and _is_constant(ctx, node, 2)
    count = len(axes) if axes is not None else (len(constant_ints(ctx, node.inputs[1], "starts", node)) if known
                                                else node.inputs[1].type.shape[0])
    given = axes if axes is not None else range(count if isinstance(count, int) else 0)
    sliced = {a % rank for a in given if -rank <= a < rank}
    if not known or any(not isinstance(x.type.shape[a], int) for a in sliced):
        if steps is not None and any(k != 1 for k in steps) or not isinstance(count, int):
            raise GraphError(f"geir.grad: Slice '{node.name}': bounds computed in the graph or a sliced axis of "
                             f"symbolic size are differentiated with unit steps and a known number of axes only "
                             f"(steps {steps}, input {list(x.type.shape)})", node=node.name)
        return [_window_back(ctx, node, grads[0], list(given))] + [None] * (len(node.inputs) - 1)
    starts = constant_ints(ctx, node.inputs[1], "starts", node)
    ends = constant_ints(ctx, node.inputs[2], "ends", node)
    shape = tuple(d if isinstance(d, int) else 0 for d in x.type.shape)    # the other axes are not read
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
        g = place_along(ctx, g, axis, read, shape[axis])
    return [g] + [None] * (len(node.inputs) - 1)


def _window_back(ctx, node, g, axes: list[int]):
    """The cotangent of a unit-step Slice's input: the output's cotangent padded with zeros before (the clamped start)
    and after (what is left) along each sliced axis, both computed at run time."""
    x = ctx.new(node.inputs[0])
    rank = len(x.type.shape)
    axes_value = ctx.ints([a % rank for a in axes])
    dims = ctx.op("Gather", ctx.op("Shape", x), axes_value)
    start = ctx.op("Cast", ctx.new(node.inputs[1]), to=7)
    start = ctx.op("Where", ctx.op("Less", start, ctx.ints([0])), ctx.op("Add", start, dims), start)
    start = ctx.op("Max", ctx.op("Min", start, dims), ctx.ints([0]))
    taken = ctx.op("Gather", ctx.op("Shape", g), axes_value)
    after = ctx.op("Sub", ctx.op("Sub", dims, start), taken)
    return ctx.op("Pad", g, ctx.op("Concat", start, after, axis=0), None, axes_value)


def scalar(ctx, like, number: float):
    """A 0-d constant of ``like``'s dtype (broadcasts against any shape)."""
    return ctx.const(np.asarray(number, like.type.dtype.numpy), "scalar")


def dim_of(ctx, x, axis: int):
    """Dim ``axis`` of a new-graph value: an int when static, else a 1-element int64 value (known at run time)."""
    size = x.type.shape[axis]
    if isinstance(size, int):
        return size
    return ctx.op("Gather", ctx.op("Shape", x), ctx.ints([axis]))


def positions_along(ctx, size):
    """The int64 vector 0..size-1 of an axis of ``size`` (an int, or a 1-element int64 value)."""
    if isinstance(size, int):
        return ctx.const(np.arange(size, dtype=np.int64), "positions")
    return ctx.op("Range", ctx.const(np.array(0, np.int64), "zero"), ctx.op("Squeeze", size, ctx.ints([0])),
                  ctx.const(np.array(1, np.int64), "one"))


def wrapped_indices(ctx, indices, size):
    """``indices`` (a new-graph value, any integer type) as int64 with negative ones counted from the end of an axis of
    ``size`` (an int or an int64 value)."""
    idx = ctx.op("Cast", indices, to=7)
    bound = ctx.ints([size]) if isinstance(size, int) else size
    return ctx.op("Where", ctx.op("Less", idx, ctx.ints([0])), ctx.op("Add", idx, bound), idx)


def place_rows(ctx, g, flat, target, axis: int):
    """The cotangent of a tensor of shape ``target`` (a static tuple, or a new-graph value whose shape it is, known at
    run time) whose rows along ``axis`` were read at the int64 positions ``flat`` (a (count, 1) value, each in
    [0, size)), given ``g``, the cotangent of what was read (its elements in the order before x count x after): a
    one-hot product, summed where a row was read more than once."""
    count = flat.type.shape[0] if isinstance(flat.type.shape[0], int) else -1    # a count known at run time only
    if isinstance(target, tuple):
        before, size, after = int(np.prod(target[:axis])), target[axis], int(np.prod(target[axis + 1:]))
        blocks, shape = ctx.ints([before, count, after]), ctx.ints(target)
    else:
        shape = ctx.op("Shape", target)
        rank = len(target.type.shape)

        def product(start: int, end: int):
            return ctx.op("ReduceProd", ctx.op("Slice", shape, ctx.ints([start]), ctx.ints([end])), keepdims=1)
        size = dim_of(ctx, target, axis)
        blocks = ctx.op("Concat", product(0, axis), ctx.ints([count]), product(axis + 1, rank), axis=0)
    onehot = ctx.op("Cast", ctx.op("Equal", flat, positions_along(ctx, size)), to=g.type.dtype.onnx)   # (count, size)
    rows = ctx.op("Reshape", g, blocks)
    spread = ctx.op("Transpose", onehot, perm=[1, 0])
    placed = one_hot_sum(ctx, lambda v: ctx.op("MatMul", spread, v), rows)              # (before, size, after)
    return ctx.op("Reshape", placed, shape)


@register_vjp("Gather", STANDARD)
def _gather(ctx, node, grads):
    """The cotangent placed back at the rows read (shapes known at run time where the types have symbols)."""
    data, indices = node.inputs
    rank = len(data.type.shape)
    axis = int(node.attributes.get("axis", 0)) % rank
    count = int(np.prod(indices.type.shape)) if indices.type.is_static else -1     # (NonZero's, say)
    target = tuple(data.type.shape) if data.type.is_static else ctx.new(data)
    size = dim_of(ctx, ctx.new(data), axis)
    flat = wrapped_indices(ctx, ctx.op("Reshape", ctx.new(indices), ctx.ints([count, 1])), size)
    return [place_rows(ctx, grads[0], flat, target, axis), None]
