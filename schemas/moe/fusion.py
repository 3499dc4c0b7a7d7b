"""Fusion pattern of the MoE family: token unpermute written with standard ops -> MoeTokenUnpermute.

``ReduceSum(Reshape(Gather(P, idx, axis=0), (T, K, H)) [* probs as (T, K, 1)], axis 1)``: the expert-sorted rows
gathered slot by slot (slot t*K + k -> row: CANN's sorted_indices convention), weighted, summed over K (without
probs: weights of one, unless K is 1). int64 indices are cast to int32. The op adds what the subgraph adds, except that it skips zero weights (a NaN row
with weight 0 stays out, as CANN does) and requires ``idx`` to be a permutation (MU-D1): a constant idx is
checked now, a fed one when the graph runs. Rows written to their slots instead (``ScatterND`` of the rows at
``Unsqueeze(row2slot, -1)``, PyTorch's ``out[row2slot] = rows``) are the gather by the inverse permutation: the
index convention is converted in the graph (ScatterElements of 0..M-1 at row2slot, the CANN sorted_indices).
"""

from __future__ import annotations

import numpy as np

from ..patterns import GraphView, Match, NearMiss, register_pattern
from .schema import FORWARD

INT32 = 6


def _weights(view: GraphView, value, tokens: int, topk: int):
    """probs (T, K) when ``value`` is probs shaped (T, K, 1) by Unsqueeze or Reshape, else None."""
    node = view.producer(value, "Unsqueeze", "Reshape")
    if node is None or tuple(value.type.shape) != (tokens, topk, 1):
        return None
    probs = node.inputs[0]
    return (probs, node) if tuple(probs.type.shape) == (tokens, topk) else None


@register_pattern("MoE unpermute (sum over K of probs * gathered rows)", "ReduceSum")
def _unpermute(view: GraphView, reduce):
    axes = view.ints(reduce.inputs[1]) if len(reduce.inputs) > 1 and reduce.inputs[1] is not None else None
    if axes is None or [a % 3 for a in axes] != [1] or reduce.attributes.get("keepdims", 1) != 0 \
            or len(reduce.inputs[0].type.shape) != 3:
        return None
    summed = reduce.inputs[0]
    tokens, topk, hidden = summed.type.shape
    mul = view.producer(summed, "Mul")
    probs, extra = None, []
    rows = summed
    if mul is not None:
        for i in (0, 1):
            found = _weights(view, mul.inputs[1 - i], tokens, topk)
            if found is not None:
                probs, shaper = found
                rows, extra = mul.inputs[i], [mul, shaper]
                break
        else:
            return NearMiss("the summed product is not gathered rows times probs shaped (T, K, 1)")
    reshape = view.producer(rows, "Reshape")
    source = reshape.inputs[0] if reshape is not None else None
    gather, scatter = view.producer(source, "Gather"), view.producer(source, "ScatterND")
    transforms = {}
    if scatter is not None:          # rows written to their slots: a gather by the inverse permutation
        found = _scattered_rows(view, scatter)
        if isinstance(found, NearMiss):
            return found
        permuted, indices = found
        transforms = {1: _inverse_permutation}
        nodes = [reduce, *extra, reshape, scatter, scatter.inputs[1].producer, scatter.inputs[2].producer]
    elif gather is None or int(gather.attributes.get("axis", 0)) != 0:
        return NearMiss("the rows summed over K are not a Gather (axis 0) or a row ScatterND, reshaped to (T, K, H)")
    else:
        permuted, indices = gather.inputs
        nodes = [reduce, *extra, reshape, gather]
    if len(permuted.type.shape) != 2 or len(indices.type.shape) != 1:
        return NearMiss(f"the Gather reads a rank-{len(permuted.type.shape)} tensor with rank-"
                        f"{len(indices.type.shape)} indices; the op takes (rows, H) and (slots,)")
    if not all(isinstance(d, int) for d in (tokens, topk, hidden)):
        return NearMiss("matches only with static (T, K, H): the Reshape's target decides K")
    constant = view.constant(indices)
    if constant is not None and not np.array_equal(np.sort(constant.reshape(-1)), np.arange(constant.size)):
        return NearMiss("the gather indices are not a permutation of 0..M-1 (MoeTokenUnpermute requires one, MU-D1)")
    casts = {1: INT32} if indices.type.dtype.onnx != INT32 else {}
    ones = {}
    if probs is None and topk > 1:      # a plain sum over K: weights of one (the op without probs has K = 1)
        ones = {2: np.ones((tokens, topk), permuted.type.dtype.numpy)}
    return Match(FORWARD.op_type, [permuted, indices, probs], {}, reduce.outputs[0], [n for n in nodes if n is not None],
                 casts=casts, constants=ones, transforms=transforms)


def _scattered_rows(view: GraphView, scatter):
    """(rows, row2slot) when ``scatter`` writes row r of ``rows`` to slot ``row2slot[r]`` of a (M, H) tensor
    (ScatterND without reduction, indices Unsqueeze(row2slot, -1)); every slot is written when row2slot is a
    permutation, so what it wrote over does not matter."""
    data, where, rows = scatter.inputs
    rows = view.through_identity_reshape(rows)
    if scatter.attributes.get("reduction", "none") != "none":
        return NearMiss("the rows are scattered with a reduction; unpermute writes each slot once")
    unsqueeze = view.producer(where, "Unsqueeze")
    if unsqueeze is None or view.ints(unsqueeze.inputs[1]) not in ([-1], [1]) or len(rows.type.shape) != 2:
        return NearMiss("the row scatter's indices are not Unsqueeze(row2slot, -1) over (rows, H) updates")
    slots = unsqueeze.inputs[0]
    if tuple(data.type.shape) != tuple(rows.type.shape):
        return NearMiss("the row scatter writes into a tensor of another shape than its rows")
    return rows, slots


def _inverse_permutation(builder, row2slot, name: str):
    """CANN's sorted_indices (slot -> row) from row2slot (row -> slot): ScatterElements of 0..M-1 at row2slot
    (distinct targets: deterministic on every runtime)."""
    count = row2slot.type.shape[0]
    dtype = row2slot.type.dtype.numpy
    rows = builder.constant(f"{name}_rows", np.arange(count, dtype=dtype))
    return builder.op("ScatterElements", rows, row2slot, rows, axis=0, name=name)
