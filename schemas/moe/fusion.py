"""Fusion pattern of the MoE family: token unpermute written with standard ops -> MoeTokenUnpermute.

``ReduceSum(Reshape(Gather(P, idx, axis=0), (T, K, H)) [* probs as (T, K, 1)], axis 1)``: the expert-sorted rows
gathered slot by slot (slot t*K + k -> row: CANN's sorted_indices convention), weighted, summed over K (without
probs: weights of one, so every fused unpermute has the one ONNX body with probs). Indices keep Gather's meaning:
a negative id counts from the end (normalised in the graph, or now for a constant idx), and an int64 id beyond
int32 saturates (the pass) instead of wrapping. The op adds what the subgraph adds, except that it skips zero
weights (a NaN row with weight 0 stays out, as CANN does: with probs that are not a constant free of zeros the
match says so in ``differs_on``, and fuses only where the caller allows it) and requires ``idx`` to be a permutation (MU-D1): a
constant idx is checked now, a fed one when the graph runs (an ExecutionError, never another result); P must have
at least M rows (the op reads ids in [R, M) as dropped slots, where Gather fails). Rows written to their slots instead (``ScatterND`` of the rows at
``Unsqueeze(row2slot, -1)``, PyTorch's ``out[row2slot] = rows``) are the gather by the inverse permutation: the
index convention is converted in the graph (ScatterElements of 0..M-1 at row2slot, the CANN sorted_indices).
Rows already in slot order, weighted before the Reshape (``ReduceSum(Reshape(rows * probs as (T*K, 1), (T, K, H)),
1)``, transformers' batched experts) are the unpermute with sorted_indices 0..T*K-1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..patterns import INT32, GraphView, Match, NearMiss, gather_ids, normalised_ids, register_pattern
from .schema import FORWARD



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
    candidates: list[tuple[Any, list[Any], Any]] = [(None, [], summed)]
    if mul is not None:             # either factor may be the probs (both may look so when T, K and H are 1)
        candidates = [(found[0], [mul, found[1]], mul.inputs[i]) for i in (0, 1)
                      if (found := _weights(view, mul.inputs[1 - i], tokens, topk)) is not None]
        if not candidates:
            return NearMiss("the summed product is not gathered rows times probs shaped (T, K, 1)")
    for probs, extra, rows in candidates:
        reshape = view.producer(rows, "Reshape")
        source = reshape.inputs[0] if reshape is not None else None
        gather, scatter = view.producer(source, "Gather"), view.producer(source, "ScatterND")
        if gather is not None or scatter is not None:
            break
    transforms: dict[int, Callable[[Any, Any, str], Any]] = {}
    if scatter is not None:          # rows written to their slots: a gather by the inverse permutation
        found = _scattered_rows(view, scatter)
        if isinstance(found, NearMiss):
            return found
        permuted, indices = found
        transforms = {1: _inverse_permutation}
        nodes = [reduce, *extra, reshape, scatter, scatter.inputs[1].producer, scatter.inputs[2].producer]
    elif gather is None and probs is None and reshape is not None and \
            (batched := _slot_major(view, source, tokens, topk)) is not None:
        return _slot_major_match(view, reduce, reshape, *batched)
    elif gather is None or int(gather.attributes.get("axis", 0)) != 0:
        return NearMiss("the rows summed over K are not a Gather (axis 0), a row ScatterND, or slot-major rows "
                        "times probs, reshaped to (T, K, H)")
    else:
        permuted, indices = gather.inputs
        nodes = [reduce, *extra, reshape, gather]
    if len(permuted.type.shape) != 2 or len(indices.type.shape) != 1:
        return NearMiss(f"the Gather reads a rank-{len(permuted.type.shape)} tensor with rank-"
                        f"{len(indices.type.shape)} indices; the op takes (rows, H) and (slots,)")
    if not all(isinstance(d, int) for d in (tokens, topk, hidden, permuted.type.shape[0], indices.type.shape[0])):
        return NearMiss("matches only with static (T, K, H): the Reshape's target decides K")
    rows_count, slots = permuted.type.shape[0], indices.type.shape[0]
    if rows_count < slots:
        return NearMiss(f"the Gather reads {rows_count} rows for {slots} slots: the op reads an index in "
                        f"[{rows_count}, {slots}) as a dropped slot, where Gather fails")
    constants, differs_on = {}, ""
    if probs is None:        # a plain sum over K: weights of one (one op form, with probs, exports for every match)
        constants[2] = np.ones((tokens, topk), permuted.type.dtype.numpy)
    else:
        differs_on = _zero_weights_differ(view, probs)
    constant = view.constant(indices)
    if constant is not None:      # gather ids (slot -> row) or scatter slots (row -> slot): a permutation either way
        normalised = normalised_ids(constant.reshape(-1), rows_count)
        if not np.array_equal(np.sort(normalised), np.arange(normalised.size)):
            what = "the row scatter's slots are" if scatter is not None else "the gather indices are"
            return NearMiss(f"{what} not a permutation of 0..M-1 (MoeTokenUnpermute requires one, MU-D1)")
        if scatter is None:
            constants[1] = normalised.astype(np.int32)
    elif scatter is None:
        transforms = {1: gather_ids(rows_count)}
    casts = {1: INT32} if indices.type.dtype.onnx != INT32 and 1 not in constants else {}
    return Match(FORWARD.op_type, [permuted, indices, probs], {}, reduce.outputs[0], [n for n in nodes if n is not None],
                 casts=casts, constants=constants, transforms=transforms, differs_on=differs_on)


def _slot_major(view: GraphView, product, tokens, topk):
    """(rows, probs, nodes) when ``product`` is ``rows * probs`` with rows (T*K, H) already in slot order (token t's
    k-th expert output at row t*K + k: transformers' batched experts, no permutation) and probs (T, K) reshaped to
    (T*K, 1) by Reshape, Unsqueeze or Flatten (row-major: slot t*K + k keeps probs[t, k]), else None. With a
    symbolic T (dynamic exports) the flattening must be read from the nodes themselves: ``Reshape(probs, [-1])``
    then ``Unsqueeze(-1)``, or ``Reshape(probs, [-1, 1])``."""
    mul = view.producer(product, "Mul")
    if mul is None or not isinstance(topk, int):
        return None
    static = isinstance(tokens, int)
    for rows, weights in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        if len(rows.type.shape) != 2 or len(weights.type.shape) != 2 or weights.type.shape[1] != 1 or \
                static and (rows.type.shape[0] != tokens * topk or weights.type.shape[0] != tokens * topk):
            continue
        found = _flattened(view, weights, tokens, topk) if static else _flattened_symbolic(view, weights, topk)
        if found is not None:
            return rows, found[0], [mul, *found[1]]
    return None


def _flattened(view: GraphView, weights, tokens: int, topk: int):
    """(probs, chain) when static ``weights`` (T*K, 1) is probs (T, K) through up to three reshaping nodes."""
    chain, value = [], weights
    while tuple(value.type.shape) != (tokens, topk) and len(chain) < 3:
        node = view.producer(value, "Reshape", "Unsqueeze", "Flatten")
        if node is None:
            break
        chain.append(node)
        value = node.inputs[0]
    return (value, chain) if tuple(value.type.shape) == (tokens, topk) else None


def _flattened_symbolic(view: GraphView, weights, topk: int):
    """(probs, chain) when ``weights`` is ``Unsqueeze(Reshape(probs, [-1]), -1)`` or ``Reshape(probs, [-1, 1])`` of
    probs (T, K) with K == ``topk``: row-major, whatever T is."""
    unsqueeze = view.producer(weights, "Unsqueeze")
    if unsqueeze is not None:
        reshape = view.producer(unsqueeze.inputs[0], "Reshape")
        if view.ints(unsqueeze.inputs[1]) not in ([-1], [1]) or reshape is None or \
                view.ints(reshape.inputs[1]) != [-1]:
            return None
        chain = [unsqueeze, reshape]
    else:
        reshape = view.producer(weights, "Reshape")
        if reshape is None or view.ints(reshape.inputs[1]) != [-1, 1]:
            return None
        chain = [reshape]
    probs = reshape.inputs[0]
    return (probs, chain) if len(probs.type.shape) == 2 and probs.type.shape[1] == topk else None


def _slot_major_match(view: GraphView, reduce, reshape, rows, probs, nodes) -> Match | NearMiss:
    """MoeTokenUnpermute of slot-major rows: sorted_indices the identity 0..T*K-1 (slot s reads row s), a constant,
    or computed from the rows' count when it is symbolic."""
    if not isinstance(rows.type.shape[1], int) or tuple(reshape.outputs[0].type.shape)[1:] != \
            (probs.type.shape[1], rows.type.shape[1]):
        return NearMiss("the slot-major rows are not reshaped to (T, K, H)")
    slots = rows.type.shape[0]
    if isinstance(slots, int) and tuple(reshape.outputs[0].type.shape) == (*probs.type.shape, rows.type.shape[1]):
        return Match(FORWARD.op_type, [rows, None, probs], {}, reduce.outputs[0], [reduce, reshape, *nodes],
                     constants={1: np.arange(slots, dtype=np.int32)}, differs_on=_zero_weights_differ(view, probs))
    if isinstance(slots, int):       # static rows, but T not probs' rows
        return NearMiss("the slot-major rows are not reshaped to (T, K, H) with T the rows of probs")
    if probs.type.shape[1] == 1:     # the reshape keeps every element: its T is the rows' count / K, however computed
        return NearMiss("K = 1 with a symbolic T: the rows' count and T are two symbols the op's rules take for "
                        "different sizes (with K > 1 they check T * K against the rows when the graph runs)")
    return Match(FORWARD.op_type, [rows, rows, probs], {}, reduce.outputs[0], [reduce, reshape, *nodes],
                 transforms={1: _identity_slots}, casts={1: INT32}, differs_on=_zero_weights_differ(view, probs),
                 same_symbols="the op's T is probs' rows; the subgraph's is the rows' count / K, and the rows are "
                              "probs' rows * K wherever the product runs (the op checks it, MU-S rules at run time)")


def _identity_slots(builder, rows, name: str):
    """0..M-1 for the M rows of ``rows``, computed when the graph runs (M is symbolic)."""
    count = builder.op("Squeeze", builder.op("Shape", rows, start=0, end=1, name=f"{name}_shape"),
                       builder.constant(f"{name}_axis", np.array([0], np.int64)), name=f"{name}_count")
    return builder.op("Range", builder.constant(f"{name}_zero", np.array(0, np.int64)), count,
                      builder.constant(f"{name}_one", np.array(1, np.int64)), name=name)


def _zero_weights_differ(view: GraphView, probs) -> str:
    """``Match.differs_on`` for weights ``probs``: empty where they are a constant without zeros, else the reason."""
    weights = view.constant(probs)
    if weights is not None and not (weights == 0).any():
        return ""
    return ("MoeTokenUnpermute skips a slot of weight 0 (as CANN does), where the subgraph multiplies its row by 0: a "
            "non-finite row there is NaN in the subgraph, not in the op")


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
    """CANN's sorted_indices (slot -> row) from row2slot (row -> slot): ScatterElements of 0..M-1 at row2slot (a
    negative slot counts from the end, as in the ScatterND) into M's, an id no slot may hold: when row2slot is no
    permutation, a slot it never wrote keeps M and the op refuses it (MU-D1), where the subgraph would keep what the
    scatter wrote over."""
    count = row2slot.type.shape[0]
    dtype = row2slot.type.dtype.numpy
    rows = builder.constant(f"{name}_rows", np.arange(count, dtype=dtype))
    unwritten = builder.constant(f"{name}_unwritten", np.full(count, count, dtype))
    return builder.op("ScatterElements", unwritten, row2slot, rows, axis=0, name=name)


_ROW_STEPS = ("Expand", "Unsqueeze", "Squeeze", "Reshape", "Gather", "Cast", "Slice", "Split", "Transpose", "Flatten")


def _picked_by_nonzero(view: GraphView, value, depth: int) -> bool:
    """Whether ``value`` is computed from a NonZero through index plumbing (Expand, Gather, Reshape, ...)."""
    node = value.producer if value is not None else None
    if node is None or node.domain != "" or depth < 0:
        return False
    if node.op_type == "NonZero":
        return True
    return node.op_type in _ROW_STEPS and _picked_by_nonzero(view, node.inputs[0], depth - 1)


@register_pattern("MoE per-expert loop (rows NonZero picked, scattered back per expert)", "ScatterElements")
def _scattered_per_expert(view: GraphView, scatter):
    """The eager loop over experts (``torch.where(expert_mask[e])`` rows, each expert's output scattered back with
    ``index_add_``) is a MoE combine geir does not fuse: reported, so that it is not skipped silently."""
    if int(scatter.attributes.get("axis", 0)) % max(len(scatter.inputs[0].type.shape), 1) != 0 or \
            not _picked_by_nonzero(view, scatter.inputs[1], 6) or \
            any(user.op_type == "Add" for user, _ in scatter.outputs[0].uses):
        return None      # scatters into zeros, summed: fusion_loop's pattern fuses them or says why not
    return NearMiss("a per-expert loop (each expert's rows picked by NonZero, its output scattered back): not a form "
                    "geir fuses; transformers' experts_implementation='batched_mm' exports the combine that fuses to "
                    "MoeTokenUnpermute")
