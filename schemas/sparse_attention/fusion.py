"""Fusion pattern of the attention family: attention over gathered key rows -> SparseFlashAttention.

The form matched is one KV head shared by all query heads, every query row attending to the K key rows its
index row lists (sparse_mode 0, sparse_block_size 1, no mask), written the plain way:
``Softmax(MatMul(q, Transpose(Gather(k, idx))) * scale) @ Gather(v, idx)`` with q (T1, N1, D), k (T2, D),
v (T2, D2), idx (T1, K) (``/ d`` for ``* scale`` too); or with padding, the scores masked by
``Where(Unsqueeze(idx >= 0, 1), scores, -inf)`` (the mask broadcast by query row) and the rows gathered by
``Max(idx, 0)``. It becomes SparseFlashAttention in the TND layout (one batch: lengths [T1] and [T2]), key and
value unsqueezed to one KV head, idx as int32 (T1, 1, K).

The op's index convention differs from the subgraph's, so the indices are converted to keep its meaning: Gather
reads a negative id from the end (the op would read -1 as padding), a masked entry may stand anywhere (the op
reads -1 as the end of the row), and a row of padding only is NaN in the subgraph (zeros in the op). A constant
idx is converted now (a near miss when the op would refuse it); a fed one in the graph (``_fed_ids``). What the
op still refuses, a repeated id in a row (SA-D3), fails the fused graph with an ExecutionError at run time,
never another result. A padded entry the op skips, where the subgraph multiplies the value row gathered there by
0 (NaN when that row is not finite): a masked match that may hold padding says so in ``differs_on``.
"""

from __future__ import annotations

import numpy as np

from ..patterns import INT32, GraphView, Match, NearMiss, gather_ids, normalised_ids, register_pattern
from .schema import FORWARD



_PREDICATES = {"GreaterOrEqual": lambda a: a >= 0, "Greater": lambda a: a > -1, "Not": lambda a: a != -1}


def _valid_of(view: GraphView, mask):
    """(idx, valid, predicate) when ``mask`` is ``Unsqueeze(valid, 1)`` with ``valid = idx >= 0``
    (GreaterOrEqual(idx, 0), Greater(idx, -1) or Not(Equal(idx, -1))), ``predicate`` valid's NumPy meaning; else a
    NearMiss. The Unsqueeze is what makes the (T1, K) mask broadcast by query row over the (T1, N1, K) scores;
    without it the mask broadcasts by head (a valid graph when T1 == N1, with another meaning)."""
    unsqueeze = view.producer(mask, "Unsqueeze")
    if unsqueeze is None or view.ints(unsqueeze.inputs[1]) not in ([1], [-2]):
        return NearMiss("the scores are masked, but the mask is not Unsqueeze(idx >= 0, axis 1): a (T1, K) mask "
                        "broadcasts by head, not by query row")
    valid = unsqueeze.inputs[0]
    node = view.producer(valid, "GreaterOrEqual", "Greater", "Not")
    if node is None:
        return None
    if node.op_type == "Not":
        equal = view.producer(node.inputs[0], "Equal")
        found = equal.inputs[0] if equal is not None and view.scalar(equal.inputs[1]) == -1 else None
    else:
        bound = view.scalar(node.inputs[1])
        found = node.inputs[0] if bound == (0 if node.op_type == "GreaterOrEqual" else -1) else None
    return None if found is None else (found, valid, _PREDICATES[node.op_type], [unsqueeze, node])


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
    logits, mask_nodes, mask = softmax.inputs[0], [], None
    where = view.producer(logits, "Where")
    if where is not None:             # masked_fill(-inf) of the padding entries
        fill = view.scalar(where.inputs[2])
        mask = _valid_of(view, where.inputs[0])
        if isinstance(mask, NearMiss):
            return mask
        if fill is None or fill != float("-inf") or mask is None:
            return NearMiss("the scores are masked, but not as Where(idx >= 0, scores, -inf)")
        logits, mask_nodes = where.inputs[1], [where, *mask[3]]
    scaled = _scale(view, logits)
    if scaled is None:
        return NearMiss("the scores are not scaled by a constant scalar before the softmax")
    scale, scores, scale_node = scaled
    product = view.producer(scores, "MatMul")
    transpose = view.producer(product.inputs[1], "Transpose") if product is not None else None
    key_gather = view.producer(transpose.inputs[0], "Gather") if transpose is not None else None
    if key_gather is None or transpose is None or list(transpose.attributes.get("perm", [])) != [0, 2, 1]:
        return NearMiss("the scores are not q @ Transpose(Gather(key, idx), [0, 2, 1])")
    query, (key, idx), (value, value_idx) = product.inputs[0], key_gather.inputs, value_gather.inputs
    if mask is not None:              # gathered with the padding replaced: the op reads -1 as padding itself
        if _safe_of(view, idx) is not mask[0] or _safe_of(view, value_idx) is not mask[0]:
            return NearMiss("masked scores need keys and values gathered by Max(idx, 0) of the masked idx")
        mask_nodes += [idx.producer, value_idx.producer]
        value_idx = idx                                # two Max nodes of one idx hold the same ids
    if idx is not value_idx or int(key_gather.attributes.get("axis", 0)) != 0 or \
            int(value_gather.attributes.get("axis", 0)) != 0:
        return NearMiss("keys and values are not gathered (axis 0) by the same index tensor")
    ranks = tuple(len(v.type.shape) for v in (query, key, value, idx))
    if ranks != (3, 2, 2, 2):
        return NearMiss(f"ranks {ranks} of (query, key, value, indices); the form matched is (T1, N1, D), (T2, D), "
                        f"(T2, D2), (T1, K)")
    if not all(v.type.is_static for v in (query, key, value, idx)):
        return NearMiss("matches only with static shapes (the lengths [T1] and [T2] become constants)")
    t1, t2, k = query.type.shape[0], key.type.shape[0], idx.type.shape[1]
    if idx.type.shape[0] != t1:
        return NearMiss(f"the index rows ({idx.type.shape[0]}) broadcast over the {t1} query rows; the op takes one "
                        f"index row per query row")
    source = mask[0] if mask is not None else idx
    constant = view.constant(source)
    found = _constant_ids(constant, t1, t2, mask) if constant is not None else \
        _fed_ids(idx, mask, t2, k)
    if isinstance(found, NearMiss):
        return found
    ids, transforms, finish = found
    padded = mask is not None and (constant is None or not mask[2](constant).all())
    differs_on = ("SparseFlashAttention skips a padded entry, where the subgraph multiplies the value row it "
                  "gathers there (row 0, through Max(idx, 0)) by a probability of 0: a non-finite value there is NaN "
                  "in the subgraph, not in the op") if padded else ""
    constants = {5: np.array([t1], np.int32), 6: np.array([t2], np.int32)}
    if ids is not None:
        constants[3] = ids.reshape(t1, 1, k)
    return Match(FORWARD.op_type, [query, key, value, idx, None, None, None], {
        "scale_value": float(np.float32(scale)), "sparse_block_size": 1, "layout_query": "TND", "layout_kv": "TND",
        "sparse_mode": 0}, matmul.outputs[0],
        [matmul, softmax, *mask_nodes, scale_node, product, transpose, key_gather, value_gather],
        reshapes={1: (t2, 1, key.type.shape[1]), 2: (t2, 1, value.type.shape[1])} | ({} if ids is not None else
                                                                                      {3: (t1, 1, k)}),
        casts={3: INT32} if ids is None and idx.type.dtype.onnx != INT32 else {},
        constants=constants, transforms=transforms, finish=finish, differs_on=differs_on)


def _constant_ids(constant, t1: int, t2: int, mask):
    """The op's int32 (T1, K) indices for a constant idx, with the subgraph's meaning (Gather's negative ids; masked
    entries as trailing -1), or a NearMiss when the op would refuse them or give another result."""
    table = constant.reshape(t1, -1).astype(np.int64)
    if mask is not None:
        valid = mask[2](table)
        padding = ~valid
        table = np.where(valid, np.maximum(table, 0), -1)
        table = -np.sort(-table, axis=1)          # the row's keys in any order (a sum), its padding at the end
    else:
        table, padding = normalised_ids(table, t2), np.zeros(table.shape, bool)
    ids = np.sort(np.where(table < 0, t2 + np.arange(table.shape[1]), table), axis=1)   # padding: unique
    kept = table[table >= 0] if mask is not None else table
    if (kept < 0).any() or (kept >= t2).any() or (ids[:, 1:] == ids[:, :-1]).any() or padding.all(axis=1).any():
        return NearMiss("an index row holds a repeated or out-of-range id, or only padding (SparseFlashAttention "
                        "needs distinct ids in [0, T2), SA-D3, and gives zeros for a row of padding where the "
                        "subgraph gives NaN)")
    return table.astype(np.int32), {}, None


def _fed_ids(idx, mask, t2: int, k: int):
    """Transforms that give a fed idx the subgraph's meaning before the op reads it: unmasked, Gather's negative
    ids (-1 is the last key, never padding); masked, ``Where(valid, Max(idx, 0), -1)`` sorted so the padding
    trails, and NaN rows where a row is only padding (softmax over -inf only, as in the subgraph). Repeated ids
    stay the op's run-time error (SA-D3)."""
    if mask is None:
        return None, {3: gather_ids(t2)}, None
    valid = mask[1]

    def masked(builder, safe, name: str):
        dtype = safe.type.dtype.numpy
        ids = builder.op("Where", valid, safe, builder.constant(f"{name}_padding", np.array(-1, dtype)),
                         name=f"{name}_padded")
        count = builder.constant(f"{name}_k", np.array([k], np.int64))
        return builder.op("TopK", ids, count, axis=-1, largest=1, sorted=1, name=name)[0]

    def nan_rows(builder, out, inputs, name: str):
        top = builder.op("ReduceMax", inputs[3], builder.constant(f"{name}_axes", np.array([-1], np.int64)),
                         keepdims=1, name=f"{name}_top")
        empty = builder.op("Less", top, builder.constant(f"{name}_zero", np.array(0, np.int32)), name=f"{name}_empty")
        nan = builder.constant(f"{name}_nan", np.array(np.nan, out.type.dtype.numpy))
        return builder.op("Where", empty, nan, out, name=name)
    return None, {3: masked}, nan_rows
