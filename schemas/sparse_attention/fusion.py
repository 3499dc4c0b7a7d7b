"""Fusion pattern of the attention family: attention over gathered key rows -> SparseFlashAttention.

The form matched is one KV head shared by all query heads, every query row attending to the K key rows its
index row lists (sparse_mode 0, sparse_block_size 1, no mask), written the plain way:
``Softmax(MatMul(q, Transpose(Gather(k, idx))) * scale) @ Gather(v, idx)`` with q (T1, N1, D), k (T2, D),
v (T2, D2), idx (T1, K) (``/ d`` for ``* scale`` too); or with -1 padding, the scores masked by
``Where(idx >= 0, scores, -inf)`` and the rows gathered by ``Max(idx, 0)``: the op reads the -1 entries as the
end of the row (SA-D3 wants them trailing; a row of padding only gives zeros there, NaN in the subgraph). It becomes SparseFlashAttention in the TND layout
(one batch: lengths [T1] and [T2]), key and value unsqueezed to one KV head, idx as int32 (T1, 1, K).
The op requires each index row to hold distinct ids in [0, T2) (SA-D3), where Gather would also take
negative ids or repeats: a constant idx is checked now (a near miss otherwise), a fed one when the graph runs.
"""

from __future__ import annotations

import numpy as np

from ..patterns import GraphView, Match, NearMiss, register_pattern
from .schema import FORWARD

INT32 = 6


def _valid_of(view: GraphView, mask):
    """idx when ``mask`` is ``idx >= 0`` (GreaterOrEqual(idx, 0), Greater(idx, -1) or Not(Equal(idx, -1))),
    possibly unsqueezed on axis 1, else None."""
    unsqueeze = view.producer(mask, "Unsqueeze")
    if unsqueeze is not None:
        if view.ints(unsqueeze.inputs[1]) not in ([1], [-2]):
            return None
        mask = unsqueeze.inputs[0]
    node = view.producer(mask, "GreaterOrEqual", "Greater", "Not")
    if node is None:
        return None
    if node.op_type == "Not":
        equal = view.producer(node.inputs[0], "Equal")
        return equal.inputs[0] if equal is not None and view.scalar(equal.inputs[1]) == -1 else None
    bound = view.scalar(node.inputs[1])
    return node.inputs[0] if bound == (0 if node.op_type == "GreaterOrEqual" else -1) else None


def _safe_of(view: GraphView, value):
    """idx when ``value`` is idx with -1 replaced by a valid id (Max(idx, 0) or Relu(idx)), else None."""
    node = view.producer(value, "Max", "Relu")
    if node is None:
        return None
    if node.op_type == "Relu":
        return node.inputs[0]
    return node.inputs[0] if len(node.inputs) == 2 and view.scalar(node.inputs[1]) == 0 else None


def _scale(view: GraphView, scores):
    """(scale, unscaled scores, node) when ``scores`` is ``x * c`` or ``x / c`` with a constant scalar c."""
    node = view.producer(scores, "Mul", "Div")
    if node is None:
        return None
    for i in ((0, 1) if node.op_type == "Mul" else (0,)):
        c = view.scalar(node.inputs[1 - i])
        if c is not None and c != 0:
            return (c if node.op_type == "Mul" else 1.0 / c), node.inputs[i], node
    return None


@register_pattern("sparse attention (softmax(q @ gathered keys^T * scale) @ gathered values)", "MatMul")
def _attention(view: GraphView, matmul):
    probs, values = matmul.inputs
    softmax = view.producer(probs, "Softmax")
    value_gather = view.producer(values, "Gather")
    if softmax is None or value_gather is None:
        return None
    if int(softmax.attributes.get("axis", -1)) % len(probs.type.shape) != len(probs.type.shape) - 1:
        return NearMiss("the softmax is not over the last axis (the keys)")
    logits, mask_nodes, mask_idx = softmax.inputs[0], [], None
    where = view.producer(logits, "Where")
    if where is not None:             # masked_fill(-inf) of the padding entries
        fill = view.scalar(where.inputs[2])
        mask_idx = _valid_of(view, where.inputs[0])
        if fill is None or fill != float("-inf") or mask_idx is None:
            return NearMiss("the scores are masked, but not as Where(idx >= 0, scores, -inf)")
        logits, mask_nodes = where.inputs[1], [where]
    scaled = _scale(view, logits)
    if scaled is None:
        return NearMiss("the scores are not scaled by a constant scalar before the softmax")
    scale, scores, scale_node = scaled
    product = view.producer(scores, "MatMul")
    transpose = view.producer(product.inputs[1], "Transpose") if product is not None else None
    key_gather = view.producer(transpose.inputs[0], "Gather") if transpose is not None else None
    if key_gather is None or list(transpose.attributes.get("perm", [])) != [0, 2, 1]:
        return NearMiss("the scores are not q @ Transpose(Gather(key, idx), [0, 2, 1])")
    query, (key, idx), (value, value_idx) = product.inputs[0], key_gather.inputs, value_gather.inputs
    if mask_idx is not None:          # gathered with the padding replaced: the op reads -1 as padding itself
        safe = _safe_of(view, idx)
        if safe is not mask_idx or _safe_of(view, value_idx) is not mask_idx:
            return NearMiss("masked scores need keys and values gathered by Max(idx, 0) of the masked idx")
        mask_nodes += [idx.producer, value_idx.producer]
        idx = value_idx = mask_idx
    if idx is not value_idx or int(key_gather.attributes.get("axis", 0)) != 0 or \
            int(value_gather.attributes.get("axis", 0)) != 0:
        return NearMiss("keys and values are not gathered (axis 0) by the same index tensor")
    ranks = tuple(len(v.type.shape) for v in (query, key, value, idx))
    if ranks != (3, 2, 2, 2):
        return NearMiss(f"ranks {ranks} of (query, key, value, indices); the form matched is (T1, N1, D), (T2, D), "
                        f"(T2, D2), (T1, K)")
    if not all(v.type.is_static for v in (query, key, value, idx)):
        return NearMiss("matches only with static shapes (the lengths [T1] and [T2] become constants)")
    t1, t2 = query.type.shape[0], key.type.shape[0]
    constant = view.constant(idx)
    if constant is not None:
        table = constant.reshape(t1, -1).astype(np.int64)
        padding = table == -1 if mask_idx is not None else np.zeros(table.shape, bool)
        ids = table[~padding]
        distinct = np.sort(np.where(padding, t2 + np.arange(table.shape[1]), table), axis=1)   # padding: unique
        if (ids < 0).any() or (ids >= t2).any() or (distinct[:, 1:] == distinct[:, :-1]).any() \
                or not np.array_equal(padding, np.cumsum(padding, axis=1) > 0) or padding.all(axis=1).any():
            return NearMiss("an index row holds a repeated, negative or out-of-range id, or padding that is not "
                            "trailing or fills the row (SparseFlashAttention needs distinct ids in [0, T2) padded at "
                            "the end with -1, SA-D3)")
    k = idx.type.shape[1]
    return Match(FORWARD.op_type, [query, key, value, idx, None, None, None], {
        "scale_value": float(np.float32(scale)), "sparse_block_size": 1, "layout_query": "TND", "layout_kv": "TND",
        "sparse_mode": 0}, matmul.outputs[0],
        [matmul, softmax, *mask_nodes, scale_node, product, transpose, key_gather, value_gather],
        reshapes={1: (t2, 1, key.type.shape[1]), 2: (t2, 1, value.type.shape[1]), 3: (t1, 1, k)},
        casts={3: INT32} if idx.type.dtype.onnx != INT32 else {},
        constants={5: np.array([t1], np.int32), 6: np.array([t2], np.int32)})
