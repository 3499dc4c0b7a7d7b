"""Fusion pattern of the MoE family: token unpermute written with standard ops -> MoeTokenUnpermute.

``ReduceSum(Reshape(Gather(P, idx, axis=0), (T, K, H)) [* probs as (T, K, 1)], axis 1)``: the expert-sorted rows
gathered slot by slot (slot t*K + k -> row: CANN's sorted_indices convention), weighted, summed over K (without
probs: weights of one, unless K is 1). int64 indices are cast to int32. The op adds what the subgraph adds, except that it skips zero weights (a NaN row
with weight 0 stays out, as CANN does) and requires ``idx`` to be a permutation (MU-D1): a constant idx is
checked now, a fed one when the graph runs.
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
    gather = view.producer(reshape.inputs[0], "Gather") if reshape is not None else None
    if gather is None or int(gather.attributes.get("axis", 0)) != 0:
        return NearMiss("the rows summed over K are not a Gather (axis 0) reshaped to (T, K, H)")
    permuted, indices = gather.inputs
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
    return Match(FORWARD.op_type, [permuted, indices, probs], {}, reduce.outputs[0], [reduce, *extra, reshape, gather],
                 casts=casts, constants=ones)
