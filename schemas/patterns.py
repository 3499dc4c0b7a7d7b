"""The registry of fusion patterns: standard-op subgraphs that are one of our ops (``geir.fuse``).

A pattern names the op type of the subgraph's last node (its anchor) and a ``match(view, node)`` that looks
back from an anchor node through producers and returns a ``Match`` (the values and attributes of our op,
and the nodes it replaces), a ``NearMiss`` (the reason a candidate did not match), or None (not a
candidate at all). The op families register theirs (``schemas/<family>/fusion.py``); the pass that
applies them is ``passes.fusion``. Matchers read the graph through ``GraphView``: producers by op type,
constant integers, static shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import TensorProto, numpy_helper

from ..ir._registry import Rows
from .onnx_slice import SliceError, slice_range

__all__ = ["GraphView", "Match", "NearMiss", "Pattern", "gather_ids", "normalised_ids", "patterns", "register_pattern"]


@dataclass
class Match:
    """A subgraph that is our ``op``: built with ``inputs`` (Values of the graph) and ``attributes``; its output
    ``output_index`` replaces ``replaces`` (a value of the graph); ``nodes`` are the standard nodes it stands for."""

    op: str
    inputs: list[Any]
    attributes: dict[str, Any]
    replaces: Any
    nodes: list[Any]
    output_index: int = 0
    casts: dict[int, int] = field(default_factory=dict)
    """Inputs to cast first (index -> ONNX dtype): an int64 index tensor our op takes as int32, say. The pass
    saturates a narrowing integer cast (a value out of int32's range becomes its bound, which no index rule
    accepts), so a fed 2**32 + r never wraps to r."""
    constants: dict[int, np.ndarray] = field(default_factory=dict)
    """Inputs that are new constants (index -> array): weights of one for a sum without probs, say, or constant
    indices normalised at fuse time."""
    reshapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Inputs to reshape first (index -> static shape): a key of one KV head, say (after any cast)."""
    transforms: dict[int, Callable[[Any, Any, str], Any]] = field(default_factory=dict)
    """Inputs computed from a value by nodes the match adds (index -> ``f(builder, value, name)``), before the
    casts: an index convention converted, say."""
    differs_on: str = ""
    """Data on which our op's defined meaning differs from the subgraph's, said as a reason (what the op skips that
    the subgraph multiplies by 0, say); the pass fuses such a match only with ``allow_stricter_data``."""
    same_symbols: str = ""
    """Why each symbolic dim of our op's output equals the subgraph's where both run (say the op's rows come from
    probs (T, K) and the subgraph's from (T*K rows) / K): the pass then declares the two symbols equal instead of
    refusing a type that names another symbol."""
    finish: Callable[[Any, Any, list[Any], str], Any] | None = None
    """``f(builder, output, inputs, name)``: nodes after our op that keep the subgraph's meaning where the op's
    differs (NaN rows where the subgraph gives NaN, say); ``inputs`` are the op's inputs as built."""


INT32 = 6
"""ONNX's element type code of int32: what our ops take their indices as (``Match.casts``)."""


@dataclass
class NearMiss:
    """A candidate that did not match, and why."""

    reason: str
    nodes: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class Pattern:
    name: str
    anchor: str
    """The standard op type of the subgraph's last node."""
    match: Callable[[GraphView, Any], Match | NearMiss | None]
    doc: str = ""


PATTERNS: Rows[Pattern] = Rows("fusion patterns anchored here")
"""Per standard op (domain "", the anchor), the patterns tried on its nodes."""


def register_pattern(name: str, anchor: str, doc: str = "") -> Callable:
    """Register ``match`` as the pattern ``name``, tried on every node of type ``anchor`` (in registration order)."""
    def decorate(match: Callable) -> Callable:
        PATTERNS.add("", anchor, Pattern(name, anchor, match, doc))
        return match
    return decorate


def patterns() -> tuple[Pattern, ...]:
    return tuple(PATTERNS.all())


class GraphView:
    """Read-only helpers for matchers over one graph."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self._last_evaluated: tuple[Any, int, np.ndarray | None] | None = None
        """The last top-level ``evaluated`` call: a matcher that asks twice for one mask gets it once (one entry, so
        a pass over many layers holds at most one mask)."""

    def producer(self, value: Any, *op_types: str) -> Any:
        """The standard node producing ``value`` if its op type is one of ``op_types``, else None."""
        node = None if value is None else value.producer
        return node if node is not None and node.domain == "" and node.op_type in op_types else None

    def constant(self, value: Any) -> np.ndarray | None:
        if value is None or value.producer is not None:
            return None
        return self.graph.constants.get(value.name)

    def filled(self, value: Any) -> np.ndarray | None:
        """What every element of ``value`` is drawn from: a constant's contents, or the fill of a ConstantOfShape
        (one element; ONNX's default is a float32 0)."""
        array = self.constant(value)
        if array is not None:
            return array
        node = self.producer(value, "ConstantOfShape")
        if node is None:
            return None
        fill = node.attributes.get("value")
        return np.zeros(1, np.float32) if fill is None else \
            numpy_helper.to_array(fill) if isinstance(fill, TensorProto) else np.asarray(fill)

    def evaluated(self, value: Any, depth: int = 8) -> np.ndarray | None:
        """The contents of ``value`` when it is a constant, or computed from constants by elementwise logic and
        selection (``_ELEMENTWISE``: And, Or, Not, Xor, comparisons, Where), as exporters leave a causal mask they did
        not fold: NumPy's broadcasting and these ops' results are ONNX's. None when it reads anything else, or would
        hold more than ``_EVALUATED_ELEMENTS`` elements."""
        last = self._last_evaluated
        if last is not None and last[0] is value and last[1] == depth:
            return last[2]
        result = self._evaluate(value, depth)
        self._last_evaluated = (value, depth, result)
        return result

    def _evaluate(self, value: Any, depth: int) -> np.ndarray | None:
        array = self.constant(value)
        if array is not None:
            return array
        node = value.producer if value is not None else None
        if node is None or node.domain != "" or node.op_type not in _ELEMENTWISE or depth <= 0 or \
                not value.type.is_static or int(np.prod(value.type.shape)) > _EVALUATED_ELEMENTS:
            return None
        parts = [self._evaluate(v, depth - 1) for v in node.inputs]
        if any(p is None for p in parts):
            return None
        result = _ELEMENTWISE[node.op_type](*parts)
        return result if tuple(result.shape) == tuple(value.type.shape) else None

    def ints(self, value: Any) -> list[int] | None:
        array = self.constant(value)
        if array is None or array.dtype.kind not in "iu":
            return None
        return [int(v) for v in array.reshape(-1)]

    def folded(self, value: Any) -> np.ndarray | None:
        """The int64 contents of a small shape computation (Shape, Slice, Concat, Gather, Unsqueeze, Squeeze, Cast,
        and integer Add, Sub, Mul, Div over constants), as exporters write ``flatten``'s target and the bounds of
        ``x[..., :d // 2]``: folded here, since type inference leaves such values symbolic. A Shape of a value with
        symbolic dims folds as far as only its static dims are read. None when it depends on data or a symbol."""
        constant = self.constant(value)
        if constant is not None:                  # as it is (an INT64_MIN bound is not a symbol)
            return constant.astype(np.int64) if constant.dtype.kind in "iu" else None
        array = self._fold(value, 0)
        return None if array is None or (array == _SYMBOLIC).any() else array

    def _fold(self, value: Any, depth: int) -> np.ndarray | None:
        """``folded``'s work: symbolic dims are ``_SYMBOLIC`` in the arrays moved around, never computed with."""
        array = self.constant(value)
        if array is not None:
            return array.astype(np.int64) if array.dtype.kind in "iu" else None
        node = value.producer if value is not None else None
        if node is None or node.domain != "" or depth > 8:
            return None
        if node.op_type == "Shape":
            dims = np.array([d if isinstance(d, int) else _SYMBOLIC for d in node.inputs[0].type.shape], np.int64)
            start, end = node.attributes.get("start"), node.attributes.get("end")
            return dims[slice(None if start is None else int(start), None if end is None else int(end))]
        parts = [None if v is None else self._fold(v, depth + 1) for v in node.inputs]
        if any(p is None and v is not None for p, v in zip(parts, node.inputs)):
            return None
        if node.op_type in _ARITHMETIC:
            if any((p == _SYMBOLIC).any() for p in parts):
                return None
            exact = _ARITHMETIC[node.op_type](*(p.astype(object) for p in parts))    # Python ints: no wrapping
            if exact is None or any(not INT64_RANGE[0] <= int(v) <= INT64_RANGE[1] for v in np.ravel(exact)):
                return None                       # an overflow: what the runtime computes is not folded here
            return np.asarray(exact, np.int64)
        if node.op_type == "Concat":
            return np.concatenate(parts, axis=int(node.attributes["axis"]))
        if node.op_type == "Cast":
            return parts[0]
        if node.op_type == "Unsqueeze":
            return np.expand_dims(parts[0], tuple(int(a) for a in parts[1]))
        if node.op_type == "Squeeze":
            return np.squeeze(parts[0], tuple(int(a) for a in parts[1])) if len(parts) > 1 and parts[1] is not None \
                else np.squeeze(parts[0])
        if node.op_type == "Gather":
            return np.take(parts[0], parts[1], axis=int(node.attributes.get("axis", 0)))
        if node.op_type == "Slice" and parts[0].ndim == 1:
            axes = parts[3] if len(parts) > 3 and parts[3] is not None else [0]
            steps = parts[4] if len(parts) > 4 and parts[4] is not None else [1]
            if list(axes) != [0] or len(parts[1]) != 1:
                return None
            try:                                     # ONNX's meaning (clamped bounds), not Python's slice rules
                return parts[0][list(slice_range(len(parts[0]), int(parts[1][0]), int(parts[2][0]), int(steps[0])))]
            except SliceError:
                return None
        return None

    def reshaped_shape(self, node: Any) -> tuple[int, ...] | None:
        """The static shape a Reshape node gives when its source is static and its target folds (``folded``)."""
        if node is None or node.op_type != "Reshape" or not node.inputs[0].type.is_static:
            return None
        target = self.folded(node.inputs[1])
        if target is None or target.ndim != 1:
            return None
        source = tuple(node.inputs[0].type.shape)
        dims = [source[i] if d == 0 and not node.attributes.get("allowzero", 0) else int(d) for i, d in enumerate(target)]
        try:
            return np.empty(source, np.int8).reshape(dims).shape
        except ValueError:
            return None

    def through_identity_reshape(self, value: Any) -> Any:
        """The source of ``value`` when it is a Reshape that gives the source's own static shape back (exporters
        write ``x.reshape(len(idx), -1)`` and the like), else ``value``."""
        node = self.producer(value, "Reshape")
        if node is not None and self.reshaped_shape(node) == tuple(node.inputs[0].type.shape):
            return node.inputs[0]
        return value

    def scalar(self, value: Any) -> float | None:
        array = self.constant(value)
        if array is None or array.size != 1 or array.dtype.kind not in "fiu" and array.dtype.name != "bfloat16":
            return None
        return float(np.asarray(array, np.float64).reshape(-1)[0])

    def only_used_by(self, value: Any, nodes: Sequence[Any]) -> bool:
        """Whether every use of ``value`` is inside ``nodes`` and it is not a graph output."""
        inside = {id(n) for n in nodes}
        return all(id(n) in inside for n, _ in value.uses) and all(o is not value for o in self.graph.outputs)

    def slice_of(self, value: Any) -> tuple[Any, int, int, int, int] | None:
        """``(source, axis, start, stop, step)`` when ``value`` is a one-axis Slice of a static-size axis, with
        start/stop normalised to that size as ONNX reads them (``onnx_slice.slice_range``: ``range(start, stop,
        step)`` is what it selects), else None."""
        node = self.producer(value, "Slice")
        if node is None:
            return None
        source = node.inputs[0]
        starts, ends = self._folded_ints(node.inputs[1]), self._folded_ints(node.inputs[2])   # (x[..., :d // 2])
        axes = self.ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else [0]
        steps = self.ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        if None in (starts, ends, axes, steps) or not len(starts) == len(ends) == len(axes) == len(steps) == 1:
            return None
        rank = len(source.type.shape)
        axis = axes[0] % rank
        size = source.type.shape[axis]
        if not isinstance(size, int):
            return None
        try:
            read = slice_range(size, starts[0], ends[0], steps[0])
        except SliceError:
            return None
        return source, axis, read.start, read.stop, read.step

    def piece_of(self, value: Any) -> tuple[Any, int, int, int, int] | None:
        """``slice_of``, or for an output of a Split of a static-size axis the same ``(source, axis, start, stop,
        1)`` of the piece it is (sizes from its split input, or equal parts), else None."""
        found = self.slice_of(value)
        node = self.producer(value, "Split")
        if found is not None or node is None:
            return found
        source = node.inputs[0]
        rank = len(source.type.shape)
        axis = int(node.attributes.get("axis", 0)) % rank
        size = source.type.shape[axis]
        sizes = self._folded_ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        count = len(node.outputs)
        if sizes is None and isinstance(size, int):
            part = -(-size // count)                      # ONNX: equal parts, the last one smaller if need be
            sizes = [min(part, max(size - part * i, 0)) for i in range(count)]
        if sizes is None or not isinstance(size, int) or sum(sizes) != size or len(sizes) != count:
            return None
        index = next(i for i, v in enumerate(node.outputs) if v is value)
        start = sum(sizes[:index])
        return source, axis, start, start + sizes[index], 1

    def _folded_ints(self, value: Any) -> list[int] | None:
        array = self.folded(value)
        return None if array is None else [int(v) for v in array.reshape(-1)]

    def last_axis(self, value: Any, axis: int) -> bool:
        return axis % len(value.type.shape) == len(value.type.shape) - 1


_SYMBOLIC = np.iinfo(np.int64).min
"""A symbolic dim inside a folded shape computation (moved by Gather, Slice, Concat; never computed with)."""


INT64_RANGE = (-2 ** 63, 2 ** 63 - 1)

_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor, "Not": np.logical_not,
    "Equal": np.equal, "Less": np.less, "LessOrEqual": np.less_equal, "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal, "Where": np.where,
}
"""What ``GraphView.evaluated`` computes: ops whose NumPy function gives ONNX's result, dtype and broadcast."""

_EVALUATED_ELEMENTS = 1 << 24


def _integer_division(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """ONNX's integer Div (truncating toward zero, as C does) on object arrays of Python ints; None on a division by
    zero."""
    if any(v == 0 for v in np.ravel(b)):
        return None
    a, b = np.broadcast_arrays(a, b)
    quotients = [abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1) for x, y in zip(np.ravel(a), np.ravel(b))]
    return np.array(quotients, dtype=object).reshape(a.shape)


_ARITHMETIC: dict[str, Callable[..., np.ndarray | None]] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": _integer_division,
}


def normalised_ids(array: np.ndarray, size: int) -> np.ndarray:
    """Indices into an axis of ``size`` as ONNX Gather reads them: ``[-size, 0)`` counts from the end; any other
    value is left as it is (out of range for Gather and for our ops' index rules alike)."""
    array = np.asarray(array).astype(np.int64)
    return np.where((array < 0) & (array >= -size), array + size, array)


def gather_ids(size: int) -> Callable[[Any, Any, str], Any]:
    """A ``Match.transforms`` entry that gives a fed index tensor Gather's meaning before our op reads it
    (``normalised_ids`` in the graph): -1 is the last row, as in the subgraph, never padding."""
    def transform(builder: Any, idx: Any, name: str) -> Any:
        dtype = idx.type.dtype.numpy
        zero = builder.constant(f"{name}_zero", np.array(0, dtype))
        low = builder.constant(f"{name}_low", np.array(-size, dtype))
        negative = builder.op("And", builder.op("Less", idx, zero, name=f"{name}_neg"),
                              builder.op("GreaterOrEqual", idx, low, name=f"{name}_inrange"), name=f"{name}_wraps")
        size_ = builder.constant(f"{name}_size", np.array(size, dtype))
        return builder.op("Where", negative, builder.op("Add", idx, size_, name=f"{name}_add"), idx, name=name)
    return transform
