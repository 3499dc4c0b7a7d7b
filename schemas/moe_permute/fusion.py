"""Fusion pattern of the moe_permute family: the exported torch permute -> MoeTokenPermute.

``tokens.index_select(0, torch.argsort(indices.view(-1)) // topk)`` exports (torch.onnx, dynamo) as
``Gather(tokens, f(TopK(Reshape(indices, [-1]), k=T*K, largest=0, sorted=1).indices), axis=0)``, f being the floor
division (``Div`` and, for negative operands, torch's ``Sub``/``Mod``/``Less``/``Equal``/``And`` correction).
``torch.argsort(..., stable=True)`` itself does not export (no ONNX function for ``aten.sort.stable``), but it need
not: ONNX defines TopK's ties by the lower index first, so this TopK is a stable argsort, ``row2slot``, exactly.

Exactness: TopK's indices are a permutation of ``0..M-1`` whatever the ids, and f is elementwise over them, so the
matcher evaluates f on every value it can be given (``0..M-1``, static M) and fuses only when f(v) == v // K for all
of them: then the Gather reads ``tokens[row2slot // K]``, the op's ``permute_tokens`` with num_out_tokens 0, for every
input. The op's data rule (ids in [0, 16777215), MP-D1) is stricter than TopK, so fed ids fuse only where the caller
allows stricter data (the pass's rule); near variants (descending or unsorted TopK, a partial k, another divisor,
another axis) are near misses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import helper

from ..patterns import GraphView, Match, NearMiss, register_pattern
from .schema import FORWARD

_MAX_SLOTS = 1 << 24
"""The largest M whose index map the matcher evaluates (every value once)."""


def _integer_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ONNX's integer Div: truncation toward zero (as C); a division by zero raises (not a match)."""
    if np.any(b == 0):
        raise ZeroDivisionError
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)


def _mod(node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.any(b == 0):
        raise ZeroDivisionError
    return np.fmod(a, b) if node.attributes.get("fmod", 0) else np.mod(a, b)


_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "Add": lambda n, a, b: a + b, "Sub": lambda n, a, b: a - b, "Mul": lambda n, a, b: a * b,
    "Div": lambda n, a, b: _integer_div(a, b), "Mod": _mod, "Neg": lambda n, a: -a, "Abs": lambda n, a: np.abs(a),
    "Less": lambda n, a, b: a < b, "LessOrEqual": lambda n, a, b: a <= b, "Greater": lambda n, a, b: a > b,
    "GreaterOrEqual": lambda n, a, b: a >= b, "Equal": lambda n, a, b: a == b, "And": lambda n, a, b: a & b,
    "Or": lambda n, a, b: a | b, "Xor": lambda n, a, b: a ^ b, "Not": lambda n, a: ~a,
    "Where": lambda n, c, a, b: np.where(c, a, b),
    "Cast": lambda n, a: a.astype(helper.tensor_dtype_to_np_dtype(int(n.attributes["to"]))),
}
"""Integer and boolean elementwise ops, as ONNX computes them (int64 wraps alike)."""


def _index_map(view: GraphView, value, source, slots: int, nodes: list, depth: int = 0) -> np.ndarray | None:
    """``value`` as a function of ``source`` evaluated on all of ``0..slots-1`` (``source`` := that range), when
    ``value`` is computed from ``source`` and constants by integer elementwise ops and shape-keeping Reshapes;
    the nodes passed are collected in ``nodes``. None otherwise."""
    if value is source:
        return np.arange(slots, dtype=source.type.dtype.numpy)
    if np.dtype(value.type.dtype.numpy).kind not in "iub":
        return None        # a float's Div and Mod are not the integer ones evaluated here: never a match
    constant = view.constant(value)
    if constant is not None:
        return constant if constant.dtype.kind in "iub" and constant.size == 1 else None
    node = value.producer
    if node is None or node.domain != "" or depth > 16:
        return None
    if node.op_type == "Reshape" and tuple(value.type.shape) == tuple(node.inputs[0].type.shape) == (slots,):
        parts = [_index_map(view, node.inputs[0], source, slots, nodes, depth + 1)]
    elif node.op_type in _ELEMENTWISE and len(value.type.shape) <= 1:
        parts = [_index_map(view, v, source, slots, nodes, depth + 1) for v in node.inputs]
    else:
        return None
    if any(p is None for p in parts):
        return None
    nodes.append(node)
    if node.op_type == "Reshape":
        return parts[0]
    try:
        with np.errstate(all="ignore"):
            result = np.asarray(_ELEMENTWISE[node.op_type](node, *(p.reshape(-1) if p.size == 1 else p for p in parts)))
    except (ZeroDivisionError, TypeError, ValueError):
        return None
    return result if result.shape in ((slots,), (1,), ()) and result.dtype.kind in "iub" else None


def _routing(view: GraphView, topk_node) -> tuple[Any, list[Any]] | NearMiss:
    """(the expert ids (T, K) or (T,), the Reshape) that ``topk_node`` sorts: all of them, ascending, stably."""
    ids = topk_node.inputs[0]
    if int(topk_node.attributes.get("largest", 1)) != 0 or int(topk_node.attributes.get("sorted", 1)) != 1:
        return NearMiss("the TopK is not an ascending sorted one (largest=0, sorted=1): not the argsort of the ids")
    if len(ids.type.shape) != 1 or int(topk_node.attributes.get("axis", -1)) not in (0, -1):
        return NearMiss("the TopK does not sort a flat (tokens * topK,) tensor")
    k = view.folded(topk_node.inputs[1])
    if k is None or [int(v) for v in k.reshape(-1)] != [ids.type.shape[0]]:
        return NearMiss("the TopK keeps fewer than all the slots (its k is not tokens * topK)")
    reshape = view.producer(ids, "Reshape")
    if reshape is not None and len(reshape.inputs[0].type.shape) in (1, 2) and reshape.inputs[0].type.is_static:
        return reshape.inputs[0], [reshape]
    return ids, []


@register_pattern("MoE permute (gather tokens by argsort(ids) // topK)", "Gather")
def _permute(view: GraphView, gather):
    if int(gather.attributes.get("axis", 0)) != 0:
        return None
    tokens, where = gather.inputs
    if len(where.type.shape) != 1 or len(tokens.type.shape) < 2 or not where.type.is_static:
        return None
    slots = where.type.shape[0]
    topk_node = _find_topk(where)
    if topk_node is None:
        return None
    found = _routing(view, topk_node)
    if isinstance(found, NearMiss):
        return found
    indices, extra = found
    if indices.type.shape[0] != tokens.type.shape[0] or indices.type.dtype.value not in ("int32", "int64"):
        return NearMiss("the sorted ids are not (tokens, topK) int32/int64 ids of the gathered tokens")
    topk = indices.type.shape[1] if len(indices.type.shape) == 2 else 1
    if not isinstance(slots, int) or slots > _MAX_SLOTS or slots != indices.type.shape[0] * topk:
        return NearMiss("matches only with static (tokens, topK) whose slots the TopK sorts")
    chain: list[Any] = []
    mapped = _index_map(view, where, topk_node.outputs[1], slots, chain)
    if mapped is None:
        return NearMiss("the gather index is not an integer elementwise function of the TopK's indices")
    if not np.array_equal(np.broadcast_to(mapped, (slots,)), np.arange(slots) // topk):
        return NearMiss(f"the gather index is not the sorted slot floor-divided by topK = {topk} for every slot")
    return Match(FORWARD.op_type, [tokens, indices], {}, gather.outputs[0], [gather, *chain, topk_node, *extra])


def _find_topk(value, depth: int = 0):
    """The TopK whose indices output ``value`` is computed from (through elementwise nodes), or None."""
    node = value.producer if value is not None else None
    if node is None or node.domain != "" or depth > 16:
        return None
    if node.op_type == "TopK":
        return node if len(node.outputs) > 1 and node.outputs[1] is value else None
    if node.op_type not in _ELEMENTWISE and node.op_type != "Reshape":
        return None
    for v in node.inputs:
        found = _find_topk(v, depth + 1)
        if found is not None:
            return found
    return None
