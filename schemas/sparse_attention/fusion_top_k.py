"""Fusion pattern of the attention family: dense attention whose scores a top-k key selection masks ->
SparseFlashAttention.

This is how DeepSeek-V3.2's eager attention reaches ONNX: the indexer picks K keys per query row with TopK, the
picks are scattered into a boolean "not selected" mask, and the mask fills an additive attention mask (or the
scores) with a large negative before the softmax::

    notsel = ScatterElements(all True (B, S, T), TopK(index_scores, K).indices, all False, axis=-1)
    mask   = Where(Unsqueeze(notsel, 1), fill, causal)          # fill: -inf or the dtype's lowest finite value
    out    = Softmax(q @ kT * scale + mask) @ v                  # q (B, N1, S, D), kT (B, N2, D, T), v (B, N2, T, D2)

(also ``Where(Unsqueeze(notsel, 1), fill, scores)`` without an additive mask, the selection as True-where-selected
with the branches swapped, and the softmax computed in float32 between two Casts). ``causal`` is 0 where a key is
visible and the fill elsewhere: bottom-right causal (sparse_mode 3) or all visible (sparse_mode 0). Static exports
hold it as a constant (or compute it from constants: ``GraphView.evaluated``); dynamic ones compute it from the
input's shape, read here as ``key position <= query position`` of one Range whose length is the scores' (the
all-True masks and'ed with it, such as an all-ones padding mask, through Cast, Expand and GatherND). It becomes
SparseFlashAttention in the BSND layout with the top-k ids as ``sparse_indices`` (one row per KV head), between
Transposes of query, key, value and output; B, S, T and K may be symbols.

The ids are TopK's indices along the last axis, so distinct and in range: the op's index rule (SA-D3) holds for
every input (unless a narrowing Cast of the subgraph's own wrapped them: then the op refuses them when the graph
runs, never reading another key). The op reads a row's first ``min(K, visible keys)`` entries only (spec 4.5), while the mask keeps every
selected visible key wherever TopK put it; so the ids are converted in the graph first: a key the causal mask hides
becomes -1, and each row is sorted so that its padding trails. Where the op's meaning differs from the subgraph's,
the match says so (``differs_on``): the op skips a masked key, where the subgraph adds the fill to its score (a
non-finite score there, or one as large as the fill, changes the subgraph's row), and a query row with no visible
selected key is zeros in the op, NaN or an average of masked keys in the subgraph.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..patterns import INT32, GraphView, Match, NearMiss, register_pattern
from .fusion import _scale
from .schema import FORWARD

_TO_BSND, _KT_TO_BSND = [0, 2, 1, 3], [0, 3, 1, 2]


def _softmax_of(view: GraphView, probs):
    """(softmax node, its logits, the nodes) when ``probs`` is Softmax(logits), possibly computed in float32 between
    Casts (``softmax(x, dtype=float32).to(x.dtype)``; the first Cast is absent where x is float32), else None."""
    nodes = []
    back = view.producer(probs, "Cast")
    if back is not None:
        probs, nodes = back.inputs[0], [back]
    softmax = view.producer(probs, "Softmax")
    if softmax is None:
        return None
    logits, nodes = softmax.inputs[0], [*nodes, softmax]
    there = view.producer(logits, "Cast") if back is not None else None
    if there is not None:
        logits, nodes = there.inputs[0], [*nodes, there]
    return softmax, logits, nodes


def _all_of(view: GraphView, value, expected: bool) -> bool:
    """Whether every element of ``value`` is ``expected`` as a bool, whatever its shape: a constant, ConstantOfShape,
    or one of those cast to bool, expanded, reshaped, or gathered from (GatherND: every element it reads is one)."""
    node = view.producer(value, "Cast", "Expand", "GatherND", "Unsqueeze", "Squeeze", "Reshape", "Transpose")
    if node is not None:
        if node.op_type == "Cast" and int(node.attributes.get("to", 0)) != TensorProto.BOOL:
            return False
        return _all_of(view, node.inputs[0], expected)       # Cast(ones, bool), Expand(True, shape), ...
    array = view.filled(value)
    return array is not None and array.size > 0 and bool((array.astype(bool) == expected).all())


def _from_top_k(view: GraphView, ids) -> bool:
    """Whether ``ids`` are TopK's indices along the last axis, through integer Casts: distinct ids in range, unless a
    narrowing Cast wrapped them (the op then refuses them when the graph runs, SA-D3)."""
    while (cast := view.producer(ids, "Cast")) is not None:
        if cast.inputs[0].type.dtype.numpy.kind not in "iu" or ids.type.dtype.numpy.kind not in "iu":
            return False
        ids = cast.inputs[0]
    top = ids.producer
    if top is None or top.op_type != "TopK" or top.domain != "" or top.outputs[1] is not ids:
        return False
    rank = len(top.inputs[0].type.shape)
    return int(top.attributes.get("axis", -1)) % rank == rank - 1


def _selection(view: GraphView, condition):
    """(ids, polarity, nodes) when ``condition`` is Unsqueeze(ScatterElements(all b, TopK ids, all not b, axis -1),
    axis 1): True where a key is not selected when ``polarity`` (b True), where it is selected otherwise; else None
    (no top-k selection), or a NearMiss when it is almost one."""
    unsqueeze = view.producer(condition, "Unsqueeze")
    scatter = view.producer(unsqueeze.inputs[0] if unsqueeze is not None else None, "ScatterElements")
    if scatter is None:
        return None
    if view.ints(unsqueeze.inputs[1]) != [1]:
        return NearMiss("the top-k selection mask is not Unsqueeze(selection, axis 1): it would not broadcast over "
                        "the heads of (B, N, S, T) scores")
    data, ids, updates = scatter.inputs
    rank = len(data.type.shape)
    if scatter.attributes.get("reduction", "none") not in ("none", b"none") or \
            int(scatter.attributes.get("axis", 0)) % rank != rank - 1 or rank != 3:
        return NearMiss("the selection is not scattered along the keys (ScatterElements of a (B, S, T) mask on its "
                        "last axis, no reduction)")
    if not _from_top_k(view, ids):
        return NearMiss("the selection mask is scattered from ids that are not TopK's indices along the keys: the "
                        "op needs distinct ids in range (SA-D3), which TopK proves")
    polarity = _all_of(view, data, True)
    if not (polarity or _all_of(view, data, False)) or not _all_of(view, updates, not polarity):
        return NearMiss("the selection mask is not one constant value with the selected keys set to the other")
    if tuple(ids.type.shape[:-1]) != tuple(data.type.shape[:-1]):
        return NearMiss(f"the top-k ids {ids.type.shape} do not give one row per query row of the mask "
                        f"{data.type.shape}")
    nodes = [unsqueeze, scatter, *(n for n in (data.producer, updates.producer) if n is not None)]
    return ids, polarity, nodes


def _fill_of(view: GraphView, value, dtype) -> float | None:
    """The fill value when ``value`` is the constant -inf or ``dtype``'s lowest finite value, else None."""
    fill = view.scalar(value)
    lowest = float(np.finfo(dtype).min) if dtype.kind == "f" or dtype.name == "bfloat16" else None
    return fill if fill is not None and (fill == float("-inf") or fill == lowest) else None


def _masked_logits(view: GraphView, logits, dtype):
    """(scaled scores, selection, additive mask or None, fill, nodes) for the forms the module docstring lists;
    None when the logits carry no top-k selection; a NearMiss when they almost do."""
    add = view.producer(logits, "Add")
    if add is not None:                        # scores + Where(selection, fill, causal)
        for i in (0, 1):
            where = view.producer(add.inputs[1 - i], "Where")
            if where is not None:
                found = _where_of(view, where, dtype)
                if found is not None:
                    if isinstance(found, NearMiss):
                        return found
                    selection, fill, base = found
                    return add.inputs[i], selection, base, fill, [add, where, *selection[2]]
        return None
    where = view.producer(logits, "Where")     # Where(selection, fill, scores [+ causal])
    found = _where_of(view, where, dtype) if where is not None else None
    if found is None or isinstance(found, NearMiss):
        return found
    selection, fill, scores = found
    base, nodes = None, [where, *selection[2]]
    inner = view.producer(scores, "Add")
    if inner is not None:
        for i in (0, 1):
            if view.evaluated(inner.inputs[1 - i]) is not None:
                scores, base, nodes = inner.inputs[i], inner.inputs[1 - i], [*nodes, inner]
                break
    return scores, selection, base, fill, nodes


def _where_of(view: GraphView, where, dtype):
    """(selection, fill, other branch) when ``where`` fills the unselected keys, else None or a NearMiss."""
    condition, when_true, when_false = where.inputs
    selection = _selection(view, condition)
    if selection is None or isinstance(selection, NearMiss):
        return selection
    fill_value, other = (when_true, when_false) if selection[1] else (when_false, when_true)
    fill = _fill_of(view, fill_value, dtype)
    if fill is None:
        return NearMiss("the unselected keys are not filled with -inf or the dtype's lowest finite value")
    return selection, fill, other


def _positions(view: GraphView, value):
    """(the Range node, its axis counted from the end) when ``value`` is ``Range(0, L, 1)`` unsqueezed: positions
    0..L-1 along one axis, every other dim 1; else None."""
    unsqueezes = []
    while (node := view.producer(value, "Unsqueeze")) is not None:
        unsqueezes.append(node)
        value = node.inputs[0]
    arange = view.producer(value, "Range")
    if arange is None or view.scalar(arange.inputs[0]) != 0 or view.scalar(arange.inputs[2]) != 1:
        return None
    axis, rank = 0, 1
    for node in reversed(unsqueezes):             # where the one axis lands as each Unsqueeze adds its own
        axes = view.ints(node.inputs[1])
        if axes is None:
            return None
        rank += len(axes)
        for a in sorted(a % rank for a in axes):
            axis += a <= axis
    return arange, axis - rank


def _visible(view: GraphView, condition) -> tuple[str, set] | None:
    """("all", {}) when ``condition`` is True everywhere, ("causal", lengths) when it is ``key position <= query
    position`` of one Range (keys along the last axis, queries along the one before; ``lengths`` its dims) and'ed
    with such all-True masks, else None: the causal mask transformers computes from the input's shape (padding of an
    all-ones attention mask included)."""
    node = view.producer(condition, "And", "LessOrEqual", "GreaterOrEqual")
    if node is not None and node.op_type == "And":
        parts = [_visible(view, v) for v in node.inputs]
        if any(p is None for p in parts):
            return None
        lengths = set().union(*(p[1] for p in parts))
        return ("causal" if lengths else "all"), lengths
    if node is not None:
        keys, queries = node.inputs if node.op_type == "LessOrEqual" else node.inputs[::-1]
        key, query = _positions(view, keys), _positions(view, queries)
        if key is None or query is None or key[1] != -1 or query[1] != -2 or key[0] is not query[0]:
            return None
        return "causal", {key[0].outputs[0].type.shape[0]}
    return ("all", set()) if _all_of(view, condition, True) else None


def _computed_mode(view: GraphView, base, fill: float, s, t) -> int | NearMiss:
    """The mode of an additive mask computed from the input's shape: ``Where(visible, 0, fill)`` with ``visible``
    causal (``_visible``) over positions 0..L-1 where L is the scores' query and key length, or everywhere; else a
    NearMiss."""
    where = view.producer(base, "Where")
    found = _visible(view, where.inputs[0]) if where is not None else None
    hidden = view.scalar(where.inputs[2]) if where is not None else None
    if found is None or view.scalar(where.inputs[1]) != 0 or hidden not in (fill, float("-inf")):
        return NearMiss("the additive mask is computed in the graph, and not as Where(key <= query of one Range, "
                        "0, the fill): a mask geir cannot read before the graph runs")
    kind, lengths = found
    if kind == "causal" and not (s == t and lengths == {s}):
        return NearMiss(f"a causal mask over positions of length {sorted(map(str, lengths))} for {s} queries and {t} "
                        f"keys: geir cannot prove them one length (a mask of length 1 broadcasts, hiding nothing)")
    return 3 if kind == "causal" else 0


def _mode_of(base: np.ndarray | None, fill: float, shape: tuple[int, ...]) -> int | NearMiss:
    """sparse_mode 0 when the additive mask hides nothing, 3 when it hides exactly the keys after bottom-right
    causal (key j visible to query row s iff j <= s + T - S) with the fill, else a NearMiss."""
    if base is None:
        return 0
    b, _, s, t = shape
    try:
        full = np.broadcast_to(base, (b, 1, s, t)) if base.ndim <= 4 else None
    except ValueError:
        full = None
    if full is None:
        return NearMiss(f"the additive mask {base.shape} does not broadcast to (B, 1, S, T) = {(b, 1, s, t)} (one "
                        f"mask for every head)")
    visible = full == 0
    hidden = (full == fill) | (full == -np.inf)
    causal = np.arange(t)[None, :] <= np.arange(s)[:, None] + (t - s)
    if not (visible | hidden).all():
        return NearMiss("the additive mask holds values other than 0 and the fill: it weights keys, it does not "
                        "only hide them")
    if visible.all():
        return 0
    if (visible == causal).all():
        return 3
    return NearMiss("the additive mask is neither causal (bottom-right) nor empty: padding or a window is not a "
                    "SparseFlashAttention mode")


_SCORE_STEPS = ("Add", "Sub", "Mul", "Div", "Where", "Tanh", "Cast", "Concat")


def _softmax_behind(view: GraphView, probs):
    """The Softmax that ``probs`` is, through Casts and a Slice (attention sinks concatenated and sliced off)."""
    for _ in range(4):
        node = view.producer(probs, "Softmax", "Cast", "Slice")
        if node is None or node.op_type == "Softmax":
            return node
        probs = node.inputs[0]
    return None


def _scores_behind(value, depth: int) -> bool:
    """Whether ``value`` is computed from a MatMul within ``depth`` elementwise steps (scale, softcap, additive mask,
    sinks, Casts), reading only values computed in the graph."""
    node = value.producer
    if node is None or node.domain != "" or depth < 0:
        return False
    if node.op_type == "MatMul":
        return True
    return node.op_type in _SCORE_STEPS and any(
        v is not None and v.producer is not None and _scores_behind(v, depth - 1) for v in node.inputs)


def _transposed(view: GraphView, builder, value, perm: list[int], name: str):
    """``Transpose(value, perm)``, composed with the Transpose that gives ``value`` (exporters write q, k and v as
    Transposes of the projections' (B, S, N, D) views): the source itself where the two cancel, so that the op reads
    the projection as it is and no tensor is moved twice."""
    inner = view.producer(value, "Transpose")
    if inner is not None and inner.attributes.get("perm") is not None:
        first = [int(a) for a in inner.attributes["perm"]]
        composed = [first[a] for a in perm]
        if composed == list(range(len(perm))):
            return inner.inputs[0]
        return builder.op("Transpose", inner.inputs[0], perm=composed, name=name)
    return builder.op("Transpose", value, perm=perm, name=name)


@register_pattern("sparse attention top-k mask (softmax(q @ k^T * scale + top-k mask) @ v)", "MatMul")
def _top_k_mask(view: GraphView, matmul):
    probs, values = matmul.inputs
    if view.producer(values, "Gather") is not None:           # the gathered form: the other pattern's
        return None
    found = _softmax_of(view, probs)
    masked = _masked_logits(view, found[1], found[1].type.dtype.numpy) if found is not None else None
    if masked is None:
        softmax = _softmax_behind(view, probs)                 # an attention-like site: reported, not skipped
        if softmax is not None and _scores_behind(softmax.inputs[0], 6):
            return NearMiss("attention over every key (no top-k selection masks the scores): dense attention stays "
                            "standard ops; SparseFlashAttention fuses where a top-k selection masks them")
        return None
    softmax, logits, softmax_nodes = found
    if isinstance(masked, NearMiss):
        return masked
    scaled = _scale(view, masked[0])
    product = view.producer(scaled[1] if scaled is not None else None, "MatMul")
    if int(softmax.attributes.get("axis", -1)) % len(logits.type.shape) != len(logits.type.shape) - 1:
        return NearMiss("the softmax is not over the last axis (the keys)")
    _, (ids, polarity, _), base_value, fill, mask_nodes = masked
    if scaled is None or product is None:
        return NearMiss("the masked scores are not q @ k^T scaled by a constant scalar")
    scale, _, scale_node = scaled
    query, key_t = product.inputs
    shapes = [tuple(v.type.shape) if v.type.has_rank else () for v in (query, key_t, values, logits)]
    if any(len(s) != 4 for s in shapes) or not all(isinstance(d, int) for d in (shapes[1][1], shapes[2][3])):
        return NearMiss(f"matches (B, N, S, D) @ (B, N2, D, T) attention with static head counts and dims; the "
                        f"shapes are {shapes}")
    (b, n1, s, d), (_, n2, _, t), (_, nv, _, d2) = shapes[:3]
    if shapes[3] != (b, n1, s, t) or shapes[1][0] != b or shapes[2][:3] != (b, n2, t) or nv != n2 or \
            n2 not in (n1, 1) or tuple(ids.type.shape[:2]) != (b, s):
        return NearMiss(f"query {shapes[0]}, keys^T {shapes[1]}, values {shapes[2]} and ids {ids.type.shape} are not "
                        f"one attention: (B, N1, S, D), (B, N2, D, T), (B, N2, T, D2), (B, S, K) with N2 = N1 or 1")
    base = view.evaluated(base_value) if base_value is not None else None
    if base_value is not None and base is None:                # computed from the input's shape
        mode = _computed_mode(view, base_value, fill, s, t)
    else:
        static = all(isinstance(d, int) for d in (b, s, t))
        mode = _mode_of(None if base is None else np.asarray(base, np.float64), fill, (b, n1, s, t)) if static \
            or base is None else NearMiss("a constant additive mask over symbolic query and key lengths")
    if isinstance(mode, NearMiss):
        return mode
    if mode == 3 and isinstance(s, int) and isinstance(t, int) and s > t:
        return NearMiss(f"causal with more query rows ({s}) than keys ({t}): the first {s - t} rows see no key, zeros "
                        f"in the op where the subgraph gives NaN or an average of hidden keys, whatever the input")
    k = ids.type.shape[-1]
    differs_on = (f"SparseFlashAttention skips a key the mask hides, where the subgraph adds {fill} to its score (a "
                  f"non-finite score there, or one as large as the fill, changes the subgraph's row), and gives zeros "
                  f"for a query row with no visible selected key, where the subgraph gives NaN or an average of "
                  f"hidden keys")

    def bsnd(perm):
        def transform(builder, value, name):
            return _transposed(view, builder, value, perm, name)
        return transform

    def sparse_ids(builder, ids, name):
        def ints(label, values):
            return builder.constant(f"{name}_{label}", np.asarray(values, np.int64))
        if mode == 3:                  # hidden keys become -1, the padding trails: the op reads every visible one
            if isinstance(s, int) and isinstance(t, int):
                bound = ints("bound", (np.arange(s) + (t - s) + 1).reshape(s, 1))
            else:                      # one length (proved): query row i sees keys 0..i, so the bound is i + 1,
                if ids.type.dtype.numpy != np.int64:     # counted along the rows of ids itself (its dims kept)
                    ids = builder.op("Cast", ids, to=7, name=f"{name}_int64")
                first = builder.op("Slice", ids, ints("start", [0]), ints("stop", [1]), ints("last", [-1]),
                                   name=f"{name}_first")
                ones = builder.op("Add", builder.op("Mul", first, ints("zero", 0), name=f"{name}_zeros"),
                                  ints("one", 1), name=f"{name}_ones")
                bound = builder.op("CumSum", ones, ints("rows", 1), name=f"{name}_bound")
            if ids.type.dtype.numpy != np.int64:
                ids = builder.op("Cast", ids, to=7, name=f"{name}_int64")
            kept = builder.op("Where", builder.op("Less", ids, bound, name=f"{name}_visible"), ids, ints("padding", -1),
                              name=f"{name}_hidden")
            count = ints("k", [k]) if isinstance(k, int) else builder.op("Shape", ids, start=2, end=3,
                                                                         name=f"{name}_k")
            top = builder.op("TopK", kept, count, axis=-1, largest=1, sorted=1, name=f"{name}_trail")[0]
            for given, got in zip(kept.type.shape[:-1], top.type.shape[:-1]):    # TopK keeps the other dims
                if isinstance(given, str) and isinstance(got, str) and given != got:
                    builder.declare_equal(given, got)
            ids = top
        rows = builder.op("Unsqueeze", ids, ints("axis", [2]), name=f"{name}_rows2")
        return rows if n2 == 1 else builder.op("Expand", rows, ints("heads", [1, 1, n2, 1]), name=name)

    def back_to_bnsd(builder, out, inputs, name):
        return builder.op("Transpose", out, perm=_TO_BSND, name=name)

    return Match(FORWARD.op_type, [query, key_t, values, ids, None, None, None], {
        "scale_value": float(np.float32(scale)), "sparse_block_size": 1, "layout_query": "BSND",
        "layout_kv": "BSND", "sparse_mode": mode}, matmul.outputs[0],
        [matmul, *softmax_nodes, *mask_nodes, scale_node, product],
        transforms={0: bsnd(_TO_BSND), 1: bsnd(_KT_TO_BSND), 2: bsnd(_TO_BSND), 3: sparse_ids},
        casts={3: INT32}, finish=back_to_bnsd, differs_on=differs_on)
