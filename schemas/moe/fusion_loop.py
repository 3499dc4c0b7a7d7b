"""Fusion pattern of the MoE family: the eager per-expert loop's combine -> MoeTokenUnpermute.

transformers' eager experts (Mixtral and the rest with ``experts_implementation="eager"``) run each expert on the
rows ``torch.where`` picks and add its weighted output back with ``final.index_add_(0, token_idx, rows)``. The
TorchScript exporter writes each ``index_add_`` as a row scatter into zeros added to the running sum::

    acc_0 = zeros (T, H);  acc_{i+1} = Add(acc_i, ScatterElements(zeros (T, H), Expand(Unsqueeze(tok_i, 1),
                                                                  Shape(u_i)), u_i, axis=0))

with ``u_i`` the expert's weighted rows (through an Expand to the shape of ``acc_i[0:1]``, which keeps them as
they are; on an empty sum it would drop a lone row, which the fused graph refuses instead: its token is out of
range). That sum is MoeTokenUnpermute over the rows of every expert, concatenated, with one slot per (token, iteration): slot
``t * n + i`` holds the row iteration ``i`` scattered to token ``t``, probs are ones (the loop weights its rows
itself, and 1 * x is x), and a slot no row was scattered to is a dropped slot (an id in [R, M), distinct). The op
adds a token's slots in iteration order, from +0, in float32, as the chain does: a skipped +0 term changes nothing,
since a sum that starts at +0 is never -0. Nothing is assumed about the routing: the slots come from the scatter's
own indices, so two rows of one iteration sent to one token give one slot, which holds the last of them as the
scatter keeps it, unless the dropped ids then pass M and the op refuses them (MU-D1) when the graph runs; a token
id out of [-T, T), which the scatter refuses, is refused too. Float32 only: in float16 or bfloat16 the chain rounds
after every add, the op once.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from ..patterns import INT32, GraphView, Match, NearMiss, register_pattern
from .schema import FORWARD

__all__: list[str] = []


def _is_positive_zero(view: GraphView, value, shape) -> bool:
    """Whether ``value`` is +0 everywhere with ``shape`` (the sum's): a constant, or ConstantOfShape of +0."""
    if value is None or tuple(value.type.shape) != tuple(shape):
        return False
    array = view.filled(value)
    return array is not None and array.size > 0 and bool((array == 0).all()) and not bool(np.signbit(array).any())


def _target_dims(view: GraphView, value) -> list | None:
    """The dims an Expand's target names: a constant, or the shape of a value (Shape without start or end), where a
    symbolic dim a Slice cuts to at most one element counts as 1 (it is 0 only when the sliced tensor is empty)."""
    constant = view.ints(value)
    if constant is not None:
        return list(constant)
    node = view.producer(value, "Shape")
    if node is None or node.attributes.get("start", 0) != 0 or node.attributes.get("end") is not None:
        return None
    dims = list(node.inputs[0].type.shape)
    cut = view.producer(node.inputs[0], "Slice")
    if cut is not None and len(cut.inputs) >= 4:
        starts, ends, axes = (view.ints(v) for v in cut.inputs[1:4])
        steps = view.ints(cut.inputs[4]) if len(cut.inputs) > 4 and cut.inputs[4] is not None else None
        if starts is not None and ends is not None and axes is not None and (steps is None or set(steps) == {1}):
            for start, end, axis in zip(starts, ends, axes):
                if 0 <= start and end - start <= 1 and not isinstance(dims[axis], int):
                    dims[axis] = 1
    return dims


def _kept_rows(view: GraphView, updates):
    """The rows an Expand gives back unchanged (its target broadcasts into the source: each dim 1 or the source's
    own static dim), else ``updates`` itself."""
    expand = view.producer(updates, "Expand")
    if expand is None:
        return updates
    source, dims = expand.inputs[0], _target_dims(view, expand.inputs[1])
    shape = list(source.type.shape)
    if dims is None or len(dims) > len(shape) or not all(
            d == 1 or isinstance(d, int) and d == s for d, s in zip(dims, shape[len(shape) - len(dims):])):
        return updates
    return source


def _link(view: GraphView, value, shape):
    """(tok, rows, nodes) when ``value`` is ``ScatterElements(+0, Expand(Unsqueeze(tok, 1), Shape(u)), u, axis=0)``
    over ``shape`` (T, H) without reduction, ``rows`` the updates as they are; a NearMiss when rows go into zeros
    by indices of another form; None when it is no row scatter into zeros."""
    scatter = view.producer(value, "ScatterElements")
    if scatter is None:
        return None
    data, index, updates = scatter.inputs
    if scatter.attributes.get("reduction", "none") != "none" or int(scatter.attributes.get("axis", 0)) != 0 or \
            len(shape) != 2 or not _is_positive_zero(view, data, shape):
        return None          # an update of a tensor, not rows put into zeros: no part of this form
    expand = view.producer(index, "Expand")
    unsqueeze = view.producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
    measure = view.producer(expand.inputs[1], "Shape") if expand is not None else None
    if unsqueeze is None or measure is None or measure.inputs[0] is not updates or \
            measure.attributes.get("start", 0) != 0 or measure.attributes.get("end") is not None or \
            view.ints(unsqueeze.inputs[1]) not in ([1], [-1]) or len(unsqueeze.inputs[0].type.shape) != 1:
        return NearMiss("the scatter's indices are not one token id per row, Expand(Unsqueeze(tok, 1), Shape(rows))")
    return unsqueeze.inputs[0], _kept_rows(view, updates), [scatter, expand, unsqueeze, measure]


def _chain(view: GraphView, add):
    """The links of the sum ending at ``add`` in iteration order (each (tok, rows, nodes)), its Adds and the zeros
    it starts from; None when ``add`` is no link of such a sum; a NearMiss for a near form."""
    shape = tuple(add.outputs[0].type.shape)
    links, adds, node = [], [], add
    while True:
        found = [(i, _link(view, node.inputs[i], shape)) for i in (0, 1)]
        found = [(i, link) for i, link in found if link is not None]
        if not found:
            return None if not links else NearMiss("the sum of row scatters adds something else")
        if any(isinstance(link, NearMiss) for _, link in found) and len(found) == 1:
            return found[0][1]
        i, link = next((i, link) for i, link in found if not isinstance(link, NearMiss))
        links.append(link)
        adds.append(node)
        before = node.inputs[1 - i]
        previous = view.producer(before, "Add")
        if previous is None or not any(_link(view, v, shape) is not None for v in previous.inputs):
            if not _is_positive_zero(view, before, shape):
                return NearMiss("the sum of row scatters does not start from +0 zeros")
            return list(reversed(links)), adds, before
        node = previous


def _continues(view: GraphView, add) -> bool:
    """Whether the sum at ``add`` goes on: an Add that reads it with a row scatter (the match is made there)."""
    shape = tuple(add.outputs[0].type.shape)
    return any(user.domain == "" and user.op_type == "Add" and any(
        v is not add.outputs[0] and _link(view, v, shape) is not None for v in user.inputs)
        for user, _ in add.outputs[0].uses)


@register_pattern("MoE per-expert loop (row scatters into zeros, summed)", "Add")
def _per_expert_loop(view: GraphView, add):
    """transformers' eager per-expert loop, exported: see the module docstring."""
    if _continues(view, add):       # one step; every Add but the sum's last is answered here, not walked back
        return None
    chain = _chain(view, add)
    if chain is None:
        return None
    if isinstance(chain, NearMiss):
        return chain
    links, adds, start = chain
    total = add.outputs[0]
    if total.type.dtype.numpy != np.float32:
        return NearMiss(f"the loop sums {total.type.dtype.value} rows: it rounds after every add, the op once "
                        f"(exact in float32 only)")
    if not isinstance(total.type.shape[1], int):
        return NearMiss("the loop's rows have a symbolic width H")
    rows = [r for _, r, _ in links]
    if any(r.type.dtype != total.type.dtype or len(r.type.shape) != 2 or r.type.shape[1] != total.type.shape[1]
           for r in rows):
        return NearMiss("the loop scatters rows of another dtype or width than its sum")
    tokens = [t for t, _, _ in links]
    iterations = len(links)
    static = total.type.shape[0] if isinstance(total.type.shape[0], int) else None

    def concatenated(builder, first, name):
        return builder.op("Concat", *rows, axis=0, name=name) if iterations > 1 else first

    def sorted_indices(builder, _, name):
        return _slots(builder, start, static, tokens, rows, name)

    def ones(builder, _, name):
        count = builder.op("Shape", start, start=0, end=1, name=f"{name}_tokens")
        shape = builder.op("Concat", count, builder.constant(f"{name}_n", np.array([iterations], np.int64)), axis=0,
                           name=f"{name}_shape")
        return builder.op("ConstantOfShape", shape, value=numpy_helper.from_array(np.ones(1, np.float32), "value"),
                          name=name)

    nodes = [*adds] + [n for _, _, link_nodes in links for n in link_nodes]
    if static is not None:
        return Match(FORWARD.op_type, [rows[0], tokens[0], None], {}, total, nodes,
                     transforms={0: concatenated, 1: sorted_indices}, casts={1: INT32},
                     constants={2: np.ones((static, iterations), np.float32)})
    return Match(FORWARD.op_type, [rows[0], tokens[0], start], {}, total, nodes,
                 transforms={0: concatenated, 1: sorted_indices, 2: ones}, casts={1: INT32},
                 same_symbols="the op's T is the rows of the sum's zeros, read from their shape when the graph runs")


def _slots(builder, zeros, static: int | None, tokens: list, rows: list, name: str):
    """CANN's sorted_indices (slot -> row) for slot ``t * n + i`` = the row iteration ``i`` scattered to token
    ``t``: row ``r`` of iteration ``i`` goes to its token (negative ids counted from the end, as the scatter does);
    a slot no row reached gets a dropped id in [R, M), in order; a token id out of [-T, T) makes slot M: out of
    range for the scatter that inverts the map, an error where the loop's scatter errs. ``zeros``: the sum's
    start, (T, H); ``static``: T when the graph fixes it."""
    n = len(tokens)
    i64 = np.int64
    if static is not None:
        count = builder.constant(f"{name}_count", np.array(static, i64))
        slots = builder.constant(f"{name}_slots", np.array(static * n, i64))
        unwritten = builder.constant(f"{name}_unwritten", np.full(static * n, -1, i64))
    else:
        count = builder.op("Squeeze", builder.op("Shape", zeros, start=0, end=1, name=f"{name}_t"),
                           builder.constant(f"{name}_axis", np.array([0], i64)), name=f"{name}_count")
        slots = builder.op("Mul", count, builder.constant(f"{name}_n", np.array(n, i64)), name=f"{name}_slots")
        minus = numpy_helper.from_array(np.array([-1], i64), "value")
        unwritten = builder.op("ConstantOfShape", builder.op("Unsqueeze", slots, builder.constant(
            f"{name}_axis1", np.array([0], i64)), name=f"{name}_m"), value=minus, name=f"{name}_unwritten")
    zero = builder.constant(f"{name}_zero", np.array(0, i64))
    width = builder.constant(f"{name}_width", np.array(n, i64))
    pieces = []
    for i, (tok, row) in enumerate(zip(tokens, rows)):
        tok = builder.op("Cast", tok, to=TensorProto.INT64, name=f"{name}_tok{i}")
        wrapped = builder.op("Where", builder.op("Less", tok, zero, name=f"{name}_negative{i}"),
                             builder.op("Add", tok, count, name=f"{name}_wrap{i}"), tok, name=f"{name}_wrapped{i}")
        outside = builder.op("Or", builder.op("Less", wrapped, zero, name=f"{name}_below{i}"),
                             builder.op("GreaterOrEqual", wrapped, count, name=f"{name}_above{i}"),
                             name=f"{name}_outside{i}")
        slot = builder.op("Add", builder.op("Mul", wrapped, width, name=f"{name}_scaled{i}"),
                          builder.constant(f"{name}_iteration{i}", np.array(i, i64)), name=f"{name}_slot{i}")
        checked = builder.op("Where", outside, slots, slot, name=f"{name}_checked{i}")
        per_row = builder.op("Shape", row, start=0, end=1, name=f"{name}_rows{i}")
        pieces.append(builder.op("Expand", checked, per_row, name=f"{name}_per_row{i}"))   # as the scatter's Expand
    row2slot = builder.op("Concat", *pieces, axis=0, name=f"{name}_row2slot") if n > 1 else pieces[0]
    one = builder.constant(f"{name}_one", np.array(1, i64))
    total_rows = builder.op("Squeeze", builder.op("Shape", row2slot, name=f"{name}_r"),
                            builder.constant(f"{name}_axis0", np.array([0], i64)), name=f"{name}_total_rows")
    row_ids = builder.op("Range", zero, total_rows, one, name=f"{name}_row_ids")
    written = builder.op("ScatterElements", unwritten, row2slot, row_ids, axis=0, name=f"{name}_written")
    empty = builder.op("Less", written, zero, name=f"{name}_empty")
    dropped = builder.op("Add", builder.op("Sub", total_rows, one, name=f"{name}_last_row"),
                         builder.op("CumSum", builder.op("Cast", empty, to=TensorProto.INT64, name=f"{name}_counted"),
                                    zero, name=f"{name}_nth"), name=f"{name}_dropped")
    return builder.op("Where", empty, dropped, written, name=name)
