"""Vector-Jacobian products of the standard ops that select, place or repeat elements.

GatherElements, GatherND (any batch_dims) and TopK place their cotangent with one-hot products (no scatter-add, so
repeated indices sum the same way on every runtime); ScatterElements and ScatterND (no reduction, or add) give the
data the cotangent where nothing was written over it and the updates what was read back at their indices; Split,
Expand, Tile, Pad (every mode; constant mode with any pads, the others on static shapes), Trilu. Index and shape
operands get no cotangent.
"""

from __future__ import annotations

import numpy as np

from ..ir._errors import GraphError
from .standard_vjp import STANDARD, constant_ints, dim_of, one_hot_sum, optional_constant_ints, optional_input, \
    place_along, place_rows, positions_along, static_shape, wrapped_indices
from .vjp import register_vjp

INT64_MAX = 2 ** 63 - 1


def place_elements(ctx, g, indices, axis: int, like):
    """The cotangent of ``like`` (a new-graph value) whose elements along ``axis`` were read at ``indices`` (a
    new-graph value of ``g``'s shape, GatherElements' indices): out[..j..] read like[..indices[..j..]..], so each
    position of ``like`` sums the cotangents of the outputs that read it. An index tensor smaller than ``like`` in
    the other axes leaves the rest zero."""
    rank = len(like.type.shape)
    size = dim_of(ctx, like, axis)
    idx = ctx.op("Unsqueeze", wrapped_indices(ctx, indices, size), ctx.ints([rank]))    # (...I..., 1)
    onehot = ctx.op("Cast", ctx.op("Equal", idx, positions_along(ctx, size)), to=g.type.dtype.onnx)   # (...I..., size)

    def product(v):       # sum over the read axis j: (...I..., size) with axis j gone, then size moved into its place
        summed = ctx.op("ReduceSum", ctx.op("Mul", ctx.op("Unsqueeze", v, ctx.ints([rank])), onehot),
                        ctx.ints([axis]), keepdims=0)
        perm = list(range(axis)) + [rank - 1] + list(range(axis, rank - 1))
        return ctx.op("Transpose", summed, perm=perm)
    placed = one_hot_sum(ctx, product, g)
    same = all(a == b for k, (a, b) in enumerate(zip(indices.type.shape, like.type.shape)) if k != axis)
    if same:
        return placed
    if like.type.is_static and placed.type.is_static:
        pads = ctx.ints([0] * rank + [a - b for a, b in zip(like.type.shape, placed.type.shape)])
    else:
        missing = ctx.op("Sub", ctx.shape_of(like), ctx.op("Shape", placed))        # 0 along the axis itself
        pads = ctx.op("Concat", ctx.ints([0] * rank), missing, axis=0)
    return ctx.op("Pad", placed, pads)


@register_vjp("GatherElements", STANDARD)
def _gather_elements(ctx, node, grads):
    data, indices = (ctx.new(v) for v in node.inputs)
    axis = int(node.attributes.get("axis", 0)) % len(data.type.shape)
    return [place_elements(ctx, grads[0], indices, axis, data), None]


@register_vjp("TopK", STANDARD)
def _top_k(ctx, node, grads):
    """The values' cotangent placed at the indices chosen (the indices output carries none)."""
    x = ctx.new(node.inputs[0])
    g = grads[0]
    if g is None:
        return [ctx.zeros_like(x), None]
    axis = int(node.attributes.get("axis", -1)) % len(x.type.shape)
    return [place_elements(ctx, g, ctx.new(node.outputs[1]), axis, x), None]


def _flat_nd_indices(ctx, node, indices, shape: tuple[int, ...]):
    """GatherND's / ScatterND's index tuples (last axis k) as int64 row numbers of the data reshaped to
    (prod(shape[:k]), ...), a (count, 1) value, each tuple entry counted from the end where negative."""
    k = indices.type.shape[-1]
    if not isinstance(k, int) or k > len(shape):
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': the index tuples' length must be static and at "
                         f"most the data's rank {len(shape)}, got {k}", node=node.name)
    count = int(np.prod(static_shape(indices, "its indices", node)[:-1]))
    flat = ctx.op("Reshape", ctx.op("Cast", indices, to=7), ctx.ints([count, k]))
    sizes = ctx.ints(shape[:k])
    wrapped = ctx.op("Where", ctx.op("Less", flat, ctx.ints([0])), ctx.op("Add", flat, sizes), flat)
    strides = [int(np.prod(shape[i + 1:k])) for i in range(k)]
    rows = ctx.op("ReduceSum", ctx.op("Mul", wrapped, ctx.ints(strides)), ctx.ints([1]), keepdims=1)   # (count, 1)
    return rows, k


@register_vjp("GatherND", STANDARD)
def _gather_nd(ctx, node, grads):
    """Rows of the data read at the index tuples, placed back by a one-hot product; with ``batch_dims`` b, the
    tuples of batch position beta read batch beta's rows: row number beta * rows-per-batch + the tuple's row."""
    batch = int(node.attributes.get("batch_dims", 0))
    shape = static_shape(node.inputs[0], "its data", node)
    rows, k = _flat_nd_indices(ctx, node, ctx.new(node.inputs[1]), shape[batch:])
    size = int(np.prod(shape[batch:batch + k]))
    batches = int(np.prod(shape[:batch]))
    if batch:
        count = rows.type.shape[0]
        offsets = np.repeat(np.arange(batches, dtype=np.int64) * size, count // batches).reshape(count, 1)
        rows = ctx.op("Add", rows, ctx.const(offsets, "batch_rows"))
    table = (batches * size,) + shape[batch + k:]
    placed = place_rows(ctx, grads[0], rows, table, 0)
    return [ctx.op("Reshape", placed, ctx.ints(shape)), None]


def _scatter(ctx, node, grads, read_back: str):
    """ScatterElements / ScatterND: the data's cotangent with the written positions zeroed (no reduction) or whole
    (add); the updates' cotangent read back at their indices (``read_back``: GatherElements or GatherND)."""
    reduction = node.attributes.get("reduction", "none")
    if reduction not in ("none", "add"):
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': reduction '{reduction}' is not differentiated "
                         f"(only none and add)", node=node.name)
    g = grads[0]
    indices, updates = ctx.new(node.inputs[1]), ctx.new(node.inputs[2])
    attrs = {"axis": node.attributes.get("axis", 0)} if node.op_type == "ScatterElements" else {}
    d_data = None
    if ctx.needs(node.inputs[0]):
        d_data = g if reduction == "add" else ctx.op(node.op_type, g, indices, ctx.zeros_like(updates), **attrs)
    d_updates = None
    if ctx.needs(node.inputs[2]):
        d_updates = ctx.op(read_back, g, indices, **attrs)
    return [d_data, None, d_updates]


@register_vjp("ScatterElements", STANDARD)
def _scatter_elements(ctx, node, grads):
    return _scatter(ctx, node, grads, "GatherElements")


@register_vjp("ScatterND", STANDARD)
def _scatter_nd(ctx, node, grads):
    return _scatter(ctx, node, grads, "GatherND")


@register_vjp("Split", STANDARD)
def _split(ctx, node, grads):
    """The pieces' cotangents concatenated back (zeros for a piece that gets none)."""
    x = ctx.new(node.inputs[0])
    axis = int(node.attributes.get("axis", 0)) % len(x.type.shape)
    pieces = [g if g is not None else ctx.zeros_like(ctx.new(v)) for g, v in zip(grads, node.outputs)]
    joined = pieces[0] if len(pieces) == 1 else ctx.op("Concat", *pieces, axis=axis)
    return [joined] + [None] * (len(node.inputs) - 1)


@register_vjp("Expand", STANDARD)
def _expand(ctx, node, grads):
    return [ctx.sum_to(grads[0], ctx.new(node.inputs[0])), None]


@register_vjp("Tile", STANDARD)
def _tile(ctx, node, grads):
    """Each copy's cotangent summed: the output seen as (r0, d0, r1, d1, ...) reduced over the r axes (that shape
    computed at run time where the input's shape or the repeats are not known)."""
    x = node.inputs[0]
    rank = len(x.type.shape)
    if rank == 0:
        return [grads[0], None]
    repeats = ctx.constant_of(node.inputs[1])
    if x.type.is_static and repeats is not None:
        interleaved = ctx.ints([n for pair in zip(np.asarray(repeats).reshape(-1).tolist(), x.type.shape)
                                for n in pair])
    else:
        pairs = [ctx.op("Unsqueeze", ctx.op("Cast", ctx.new(node.inputs[1]), to=7), ctx.ints([1])),
                 ctx.op("Unsqueeze", ctx.op("Shape", ctx.new(x)), ctx.ints([1]))]
        interleaved = ctx.op("Reshape", ctx.op("Concat", *pairs, axis=1), ctx.ints([2 * rank]))
    g = ctx.op("Reshape", grads[0], interleaved)
    return [ctx.op("ReduceSum", g, ctx.ints(list(range(0, 2 * rank, 2))), keepdims=0), None]


def _pad_amounts(ctx, node, rank: int) -> list[int]:
    """The node's pads as ONNX orders them (every axis's begin, then every axis's end), over all ``rank`` axes."""
    if "pads" in node.attributes:                                            # Pad before opset 11
        pads = [int(p) for p in node.attributes["pads"]]
    else:
        pads = constant_ints(ctx, node.inputs[1], "pads", node)
    given = optional_constant_ints(ctx, node, 3, "axes")
    axes = list(range(rank)) if given is None else [a % rank for a in given]
    full = [0] * (2 * rank)
    for i, axis in enumerate(axes):
        full[axis], full[rank + axis] = pads[i], pads[len(axes) + i]
    return full


@register_vjp("Pad", STANDARD)
def _pad(ctx, node, grads):
    """Constant mode: the cotangent cropped where the pad added (a Slice) and zero-padded where it cropped. Reflect,
    edge, wrap: each input position sums the cotangents of the outputs that copied it (static shapes)."""
    x = ctx.new(node.inputs[0])
    rank = len(x.type.shape)
    pads = _pad_amounts(ctx, node, rank)
    mode = node.attributes.get("mode", "constant")
    g = grads[0]
    rest = [None] * (len(node.inputs) - 1)
    if mode == "constant":
        added = [max(p, 0) for p in pads]
        if any(added):
            ends = [-added[rank + i] if added[rank + i] else INT64_MAX for i in range(rank)]
            g = ctx.op("Slice", g, ctx.ints(added[:rank]), ctx.ints(ends), ctx.ints(list(range(rank))))
        cropped = [max(-p, 0) for p in pads]
        if any(cropped):
            g = ctx.op("Pad", g, ctx.ints(cropped))
        return [g] + rest
    shape = static_shape(node.inputs[0], "its input", node)
    if min(pads) < 0:
        raise GraphError(f"geir.grad: Pad '{node.name}': negative pads are differentiated in constant mode only, got "
                         f"{pads} in mode {mode}", node=node.name)
    numpy_mode = {"reflect": "reflect", "edge": "edge", "wrap": "wrap"}.get(mode)
    if numpy_mode is None:
        raise GraphError(f"geir.grad: Pad '{node.name}': unknown mode {mode!r}", node=node.name)
    for axis in range(rank):
        if pads[axis] or pads[rank + axis]:
            sources = np.pad(np.arange(shape[axis]), (pads[axis], pads[rank + axis]), mode=numpy_mode)
            g = place_along(ctx, g, axis, [int(s) for s in sources], shape[axis])
    return [g] + rest


@register_vjp("Trilu", STANDARD)
def _trilu(ctx, node, grads):
    """The same triangle of the cotangent (the rest was zeroed, so it gets nothing)."""
    k = ctx.new(optional_input(node, 1))
    attrs = {"upper": int(node.attributes.get("upper", 1))}
    result = ctx.op("Trilu", grads[0], k, **attrs) if k is not None else ctx.op("Trilu", grads[0], **attrs)
    return [result] + [None] * (len(node.inputs) - 1)

