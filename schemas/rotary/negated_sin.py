"""The rotary grad as the forward with negated sin, where a device has the forward but not the grad (spec 6.2).

The grad uses each element's partner's sin (``y[a] = c[a] g[a] + n[b] g[b]``, ``y[b] = c[b] g[b] - n[a] g[a]``); the
forward with ``-sin`` computes ``c[a] g[a] + n[a] g[b]`` and ``c[b] g[b] - n[b] g[a]``. They are the same function
exactly when the tables are pair-duplicated (``c[a] == c[b]``, ``n[a] == n[b]`` for every pair) in modes 0-2 (mode 3
reads and writes different layouts), and then the same bits: every kernel and the ONNX body compute ``c * g + m *
g[partner]`` with ``m = sign * n[partner]`` (grad) or ``-sign * (-n)`` (forward), equal products, one rounding.

Duplication must be proven from the graph, never assumed: a constant table is compared bit for bit; a computed one
must be built so that it is duplicated for every input (``pair_duplicated``): ``cat(t, t)`` on the last axis (half
pairs), ``t`` repeated along a new last axis and flattened (interleave pairs: ``repeat_interleave``), a ``Gather``
on the last axis by constant indices equal on every pair, and elementwise ops and shape ops that keep the last axis
applied to such values (``cos(cat(f, f))``). Anything else is not proven, and the substitute declines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto, numpy_helper

from ...ir._dtypes import DType
from ...ir._types import TensorType
from ..vjp import register_substitute
from .rotation import rotation_tables
from .schema import FORWARD, GRAD

__all__ = ["pair_duplicated"]

MAX_DEPTH = 32
UNARY = frozenset({"Identity", "Cast", "CastLike", "Neg", "Abs", "Cos", "Sin", "Exp", "Log", "Sqrt", "Reciprocal",
                   "Tanh", "Sigmoid", "Relu", "Erf", "Floor", "Ceil", "Round", "Sign"})
"""Elementwise ops of one data input (CastLike's second input gives only a type)."""
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Where"})
"""Broadcasting elementwise ops: duplicated when every input is."""
NONDETERMINISTIC = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                              "Bernoulli", "Dropout"})
"""Ops two nodes of which, with the same inputs, may give different values."""
Pairs = tuple[np.ndarray, np.ndarray]


def _pairs(mode: int, length: int) -> Pairs:
    """The positions (a, b) of every pair of ``mode`` on a slice of ``length``."""
    tables = rotation_tables(mode, length)
    first = np.flatnonzero(tables.sign > 0)
    return first, tables.partner[first]


def _axes(view: Any, node: Any, position: int, rank: int) -> list[int] | None:
    ints = view.ints(node.inputs[position]) if len(node.inputs) > position and node.inputs[position] is not None \
        else None
    return None if ints is None else [a % rank for a in ints]


def _constant(view: Any, value: Any) -> np.ndarray | None:
    array = view.constant(value)
    if array is not None:
        return array
    node = view.producer(value, "Constant")
    tensor = None if node is None else node.attributes.get("value")
    return numpy_helper.to_array(tensor) if isinstance(tensor, TensorProto) else None


def pair_duplicated(view: Any, value: Any, pairs: Pairs, depth: int = 0) -> bool:
    """Whether ``value`` (of a graph ``view`` reads) holds equal bits at positions ``a`` and ``b`` of its last axis
    for every pair, for every input of the graph; False when that is not proven. Each (value, pairs) is decided
    once per top-level call: a graph that reuses values (``Add(t, t)`` chains) costs its size, not 2**depth."""
    key = ("pairs", id(value), pairs[0].tobytes(), pairs[1].tobytes())
    return _memoised(key, depth, lambda: _pair_duplicated(view, value, pairs, depth))


_MEMO = threading.local()


def _memoised(key: tuple, depth: int, decide: Callable[[], bool]) -> bool:
    """``decide()`` once per key within the outermost call (depth 0 opens and closes the table; per thread)."""
    outermost = depth == 0 and getattr(_MEMO, "table", None) is None
    if outermost:
        _MEMO.table = {}
    try:
        table: dict[tuple, bool] = _MEMO.table
        if key not in table:
            table[key] = decide()
        return table[key]
    finally:
        if outermost:
            _MEMO.table = None


def _pair_duplicated(view: Any, value: Any, pairs: Pairs, depth: int) -> bool:
    shape = value.type.shape
    if not shape or shape[-1] == 1:
        return True                               # one value along the last axis (broadcast)
    if shape[-1] != 2 * len(pairs[0]) or depth > MAX_DEPTH:
        return False
    array = _constant(view, value)
    if array is not None:
        array = np.asarray(array)
        first, second = (np.ascontiguousarray(array[..., side]).tobytes() for side in pairs)
        return first == second
    node = value.producer
    if node is None or node.domain != "":
        return False
    op, rank, source = node.op_type, len(shape), node.inputs[0]

    def same(v: Any) -> bool:
        return v is not None and pair_duplicated(view, v, pairs, depth + 1)
    if op in UNARY:
        return same(source)
    if op in ELEMENTWISE:
        return all(same(v) for v in node.inputs)
    if op == "Concat":
        if int(node.attributes["axis"]) % rank != rank - 1:
            return all(same(v) for v in node.inputs)
        return _concat_duplicated(view, node.inputs, pairs)
    if op == "Expand":
        return same(source)                       # the last dim is L (each element read once) or 1 (broadcast)
    if op == "Reshape":
        src = source.type.shape
        if src and src[-1] == shape[-1]:          # row-major with an equal last dim: every row is a row of the source
            return same(source)
        return _interleaved(view, node, pairs, depth)
    if op in ("Unsqueeze", "Squeeze", "Transpose", "Slice", "Tile", "Gather"):
        return _keeps_last_axis(view, node, rank, pairs, depth)
    return False


def _keeps_last_axis(view: Any, node: Any, rank: int, pairs: Pairs, depth: int) -> bool:
    """Shape ops that carry the source's last axis through unchanged (or, Gather, pick along it by constants)."""
    op, source = node.op_type, node.inputs[0]
    source_rank = len(source.type.shape)
    if op == "Unsqueeze":
        axes = _axes(view, node, 1, rank)
        keeps = axes is not None and rank - 1 not in axes
    elif op == "Squeeze":
        axes = _axes(view, node, 1, source_rank)
        keeps = axes is not None and source_rank - 1 not in axes
    elif op == "Transpose":
        perm = node.attributes.get("perm")
        keeps = perm is not None and int(perm[-1]) == source_rank - 1
    elif op == "Slice":
        axes = _axes(view, node, 3, source_rank) if len(node.inputs) > 3 else list(range(source_rank))
        keeps = axes is not None and source_rank - 1 not in axes
    elif op == "Tile":                            # repeated along the last axis: one value there, or not proven
        repeats = view.ints(node.inputs[1])
        if repeats is not None and repeats[-1] != 1:
            return source.type.shape[-1] == 1
        keeps = repeats is not None
    else:                                         # Gather
        axis = int(node.attributes.get("axis", 0)) % source_rank
        if axis != source_rank - 1:
            keeps = True
        else:
            index = view.ints(node.inputs[1])
            width = source.type.shape[-1]
            if index is None or len(node.inputs[1].type.shape) != 1 or not isinstance(width, int):
                return False
            picked = np.asarray(index) % max(width, 1)
            return bool(np.array_equal(picked[pairs[0]], picked[pairs[1]]))
    return keeps and pair_duplicated(view, source, pairs, depth + 1)


def _concat_duplicated(view: Any, parts: list[Any], pairs: Pairs) -> bool:
    """cat on the last axis: every pair reads one position of one part, or of two parts that are the same values
    (``cat(t, t)``; ``cat(unsqueeze(t), unsqueeze(t))``)."""
    origin: list[tuple[Any, int]] = []
    for part in parts:
        width = part.type.shape[-1] if part is not None and part.type.shape else None
        if not isinstance(width, int):
            return False
        origin += [(part, k) for k in range(width)]
    return all(origin[a][1] == origin[b][1] and _same(view, origin[a][0], origin[b][0])
               for a, b in zip(pairs[0].tolist(), pairs[1].tolist()))


def _same(view: Any, a: Any, b: Any, depth: int = 0) -> bool:
    """Whether ``a`` and ``b`` hold the same bits for every input: one value, equal constants, or one output of two
    nodes of one deterministic op with the same attributes and the same inputs (each pair decided once)."""
    return _memoised(("same", id(a), id(b)), depth, lambda: _same_bits(view, a, b, depth))


def _same_bits(view: Any, a: Any, b: Any, depth: int) -> bool:
    if a is b:
        return True
    left, right = _constant(view, a), _constant(view, b)
    if left is not None and right is not None:
        return left.dtype == right.dtype and left.shape == right.shape and left.tobytes() == right.tobytes()
    p, q = a.producer, b.producer
    if p is None or q is None or depth > MAX_DEPTH or (p.op_type, p.domain) != (q.op_type, q.domain) \
            or p.op_type in NONDETERMINISTIC or p.attributes != q.attributes or len(p.inputs) != len(q.inputs) \
            or [v is a for v in p.outputs] != [v is b for v in q.outputs]:
        return False
    return all((x is None and y is None) or (x is not None and y is not None and _same(view, x, y, depth + 1))
               for x, y in zip(p.inputs, q.inputs))


def _interleaved(view: Any, node: Any, pairs: Pairs, depth: int) -> bool:
    """``t`` repeated along a new last axis of 2 and flattened (``repeat_interleave(t, 2, -1)``): interleave pairs
    (2i, 2i + 1), when the source (..., L/2, 2) holds one value along its last axis."""
    source, out = node.inputs[0].type.shape, node.outputs[0].type.shape
    first = np.arange(0, 2 * len(pairs[0]), 2)
    if not (np.array_equal(pairs[0], first) and np.array_equal(pairs[1], first + 1) and len(source) == len(out) + 1
            and source[-1] == 2 and isinstance(source[-2], int) and 2 * source[-2] == out[-1]
            and list(source[:-2]) == list(out[:-1])):
        return False
    return pair_duplicated(view, node.inputs[0], (np.array([0]), np.array([1])), depth + 1)


@register_substitute(GRAD.op_type)
def _forward_with_negated_sin(ctx: Any, node: Any, inputs: list) -> tuple[tuple, str] | str:
    mode = node.attributes["rotary_mode"]
    if mode == 3:
        return "mode 3 reads and writes different layouts: the forward with negated sin is not its grad"
    dy, cos, sin = inputs
    length = cos.type.shape[-1]
    if not isinstance(length, int):
        return f"the tables' last dim is symbolic ({length}): their pairs cannot be compared"
    pairs = _pairs(mode, length)
    unproven = [name for name, table in (("cos", node.inputs[1]), ("sin", node.inputs[2]))
                if not pair_duplicated(ctx.view, table, pairs)]
    if unproven:
        return f"{' and '.join(unproven)} not proven pair-duplicated (a constant, or a table built duplicated)"
    wide = cos.type.dtype != DType.FLOAT32
    types = [dy.type] + [TensorType(DType.FLOAT32, t.type.shape) if wide else t.type for t in (cos, sin)]
    refused = ctx.refused(FORWARD, types, node.attributes, node)
    if refused:
        return f"the forward with negated sin breaks {', '.join(refused)} on {ctx.target}"
    if wide:
        cos, sin = (ctx.b.op("Cast", t, to=DType.FLOAT32.onnx, name=ctx.fresh("rotary_table")) for t in (cos, sin))
    negated = ctx.b.op("Neg", sin, name=ctx.fresh("rotary_negated_sin"))
    made = ctx.b.add_node(FORWARD, [dy, cos, negated], dict(node.attributes), name=node.name,
                          output_names=[node.outputs[0].name], location=node.location)
    return (made,), "InplacePartialRotaryMul(dy, cos, -sin): cos and sin pair-duplicated (spec 6.2), same bits"
