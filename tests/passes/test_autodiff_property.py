"""geir.grad on random graphs (issue 23, "make the class impossible"): small graphs built from every op that has a VJP
rule, standard ONNX ops and ours, with random shapes and attributes (broadcasting operands, negative axes, strided and
reversed slices with INT64 sentinels, repeated and negative gather indices, pass-through outputs, subsets of wrt), each
against float64 central differences of the reference. The default run draws a fixed set (derandomised); the slow
marker runs a longer one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import geir
from geir.schemas import get_schema
from geir.schemas.vjp import vjp_ops
from geir.testing import reference
from sparse_attention.helpers import AttentionCase

EPS = 1e-6
MAX_SIZE = 96
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
COUNTS: dict[str, int] = {}
"""How many checked graphs contained each op, and how many graphs were checked (a tally for reports)."""


@dataclass
class Gen:
    """A graph under construction: the builder, the float32 values ops may read, the feeds of the inputs."""

    draw: Callable
    b: geir.GraphBuilder = field(default_factory=lambda: geir.GraphBuilder("random"))
    values: list = field(default_factory=list)
    positive: list = field(default_factory=list)     # inputs fed values in [0.5, 1.5]: Div's denominators
    feeds: dict = field(default_factory=dict)
    ops: set = field(default_factory=set)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    count: int = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def input(self, shape, dtype: str = "float32", array: np.ndarray | None = None):
        value = self.b.input(self.name("in"), dtype, tuple(shape))
        self.feeds[value.name] = np.asarray(self.rng.uniform(0.5, 1.5, shape), dtype) if array is None else array
        if array is None and dtype == "float32":
            self.positive.append(value)
        return value

    def ints(self, values, dtype=np.int64):
        return self.b.constant(self.name("c"), np.asarray(values, dtype))

    def op(self, op_type: str, *inputs, **attrs):
        self.ops.add(op_type)
        return getattr(self.b, op_type)(*inputs, **attrs) if op_type in OURS else self.b.op(op_type, *inputs, **attrs)

    def pick(self, rank_at_least: int = 0):
        """A value to read: the newest one that qualifies more often than not (graphs grow deep, not only wide)."""
        choices = [v for v in self.values if len(v.type.shape) >= rank_at_least]
        if not choices:
            return None
        return choices[-1] if self.draw(st.booleans()) else self.draw(st.sampled_from(choices))


OURS = ("InplacePartialRotaryMul", "InplacePartialRotaryMulGrad", "MoeTokenUnpermute", "MoeTokenUnpermuteGrad",
        "MoeTokenPermute", "MoeTokenPermuteGrad", "SparseFlashAttention")


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _broadcast_partner(g: Gen, shape: tuple) -> tuple:
    """A shape that broadcasts with ``shape``: dims kept or 1, leading dims dropped, or one leading dim added."""
    dims = [d if g.draw(st.booleans()) else 1 for d in shape]
    kind = g.draw(st.sampled_from(["same", "drop", "add"]))
    if kind == "drop" and dims:
        dims = dims[g.draw(st.integers(1, len(dims))):]
    elif kind == "add" and _size(shape) * 2 <= MAX_SIZE and len(shape) < 4:
        dims = [2] + dims
    return tuple(dims)


def _binary(g: Gen, op_type: str):
    a = g.pick()
    if op_type == "Div":          # denominators away from zero: an input fed [0.5, 1.5]
        partner = _broadcast_partner(g, a.type.shape)
        denominator = g.draw(st.sampled_from([v for v in g.positive if v.type.shape == partner] or [None]))
        return g.op("Div", a, denominator if denominator is not None else g.input(partner))
    other = a if g.draw(st.booleans()) and g.draw(st.booleans()) else g.input(_broadcast_partner(g, a.type.shape))
    return g.op(op_type, *((a, other) if g.draw(st.booleans()) else (other, a)))


def _matmul(g: Gen):
    a = g.pick(2)
    if a is None:
        return None
    n = g.draw(st.integers(1, 3))
    batch = _broadcast_partner(g, a.type.shape[:-2]) if g.draw(st.booleans()) else ()
    if g.draw(st.booleans()):
        return g.op("MatMul", a, g.input(batch + (a.type.shape[-1], n)))
    return g.op("MatMul", g.input(batch + (n, a.type.shape[-2])), a)


def _reshape_target(g: Gen, shape: tuple) -> list[int]:
    size, dims = _size(shape), []
    while size > 1 and len(dims) < 3:
        factor = g.draw(st.sampled_from([f for f in range(1, size + 1) if size % f == 0]))
        dims.append(factor)
        size //= factor
    dims.append(size)
    if g.draw(st.booleans()):
        dims[g.draw(st.integers(0, len(dims) - 1))] = -1
    return dims


def _slice(g: Gen):
    a = g.pick(1)
    rank = len(a.type.shape)
    axes = g.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    bound = st.one_of(st.integers(-6, 6), st.sampled_from([INT64_MIN, -2 ** 62, 2 ** 62, INT64_MAX]))
    starts, ends = ([g.draw(bound) for _ in axes] for _ in range(2))
    steps = [g.draw(st.sampled_from([-3, -2, -1, 1, 2, 3])) for _ in axes]
    given_axes = [ax - rank if g.draw(st.booleans()) else ax for ax in axes]
    return g.op("Slice", a, g.ints(starts), g.ints(ends), g.ints(given_axes), g.ints(steps))


def _gather(g: Gen):
    a = g.pick(1)
    rank = len(a.type.shape)
    axis = g.draw(st.integers(-rank, rank - 1))
    size = a.type.shape[axis]
    index_shape = tuple(g.draw(st.lists(st.integers(1, 3), max_size=2)))
    indices = g.rng.integers(-size, size, index_shape)
    return g.op("Gather", a, g.ints(indices, g.draw(st.sampled_from([np.int64, np.int32]))), axis=axis)


def _as_4d(g: Gen, a):
    """``a`` as (1, S, N, D) with D its last dim (a Reshape when it is not 4-D already)."""
    if len(a.type.shape) == 4:
        return a
    d = a.type.shape[-1] if a.type.shape else 1
    rest = _size(a.type.shape) // d
    s = g.draw(st.sampled_from([f for f in range(1, rest + 1) if rest % f == 0]))
    return g.op("Reshape", a, g.ints([1, s, rest // s, d]))


def _rotary(g: Gen, op_type: str):
    a = g.pick(1)
    mode = g.draw(st.integers(0, 3))
    x = _as_4d(g, a)
    shape = x.type.shape
    unit = 4 if mode == 2 else 2
    if shape[3] < unit:
        return None
    length = unit * g.draw(st.integers(1, shape[3] // unit))
    start = g.draw(st.integers(0, shape[3] - length))
    table = tuple(d if g.draw(st.booleans()) else 1 for d in shape[:3]) + (length,)
    if op_type == "InplacePartialRotaryMul" and g.draw(st.booleans()):
        cos, sin = g.input(table), g.input(table)             # differentiated too
    else:                                                    # the grad op's tables are constants (not linear there)
        dtype = g.draw(st.sampled_from(["float32", "float16"])) if op_type != "InplacePartialRotaryMul" else "float32"
        cos, sin = (g.b.constant(g.name("table"), g.rng.uniform(-1, 1, table).astype(dtype)) for _ in range(2))
    return g.op(op_type, x, cos, sin, rotary_mode=mode, partial_slice=[start, start + length])


def _moe(g: Gen, op_type: str):
    a = g.pick(1)
    h = a.type.shape[-1]
    rows = g.op("Reshape", a, g.ints([-1, h]))
    r = rows.type.shape[0]
    probs_k = g.draw(st.sampled_from([0, 1, 2, 3]))
    if op_type == "MoeTokenUnpermute":
        slots = g.draw(st.integers(max(1, r - 2), r + 2))     # rows != slots: dropped slots or unread rows
        k = probs_k if probs_k and slots % probs_k == 0 else 0
        probs = g.input((slots // k, k)) if k else None
        indices = g.ints(g.rng.permutation(slots), np.int32)
        return g.op(op_type, rows, indices, probs)
    with_probs = probs_k > 0
    k = probs_k if with_probs else 1
    tokens = g.input((r * k, h)) if with_probs or g.draw(st.booleans()) else None   # probs need the tokens
    probs = g.input((r, k)) if with_probs else None
    indices = g.ints(g.rng.permutation(r * k), np.int32)
    ptg, pg = g.op(op_type, tokens, rows, indices, probs)
    if with_probs:
        g.values.append(pg)
    return ptg


def _moe_permute(g: Gen, op_type: str):
    """The dispatch over rows of a drawn value (expert ids constant, some rows dropped by num_out_tokens), or its
    grad over rows grouped by a drawn topK with a constant slot -> row permutation."""
    a = g.pick(1)
    h = a.type.shape[-1]
    rows = g.op("Reshape", a, g.ints([-1, h]))
    r = rows.type.shape[0]
    if op_type == "MoeTokenPermute":
        k = g.draw(st.integers(1, 3))
        ids = g.ints(g.rng.integers(0, 4, (r, k)), g.draw(st.sampled_from([np.int32, np.int64])))
        kept = g.draw(st.sampled_from([0, -1, max(1, r * k - 1)]))
        permuted, _ = g.op(op_type, rows, ids, num_out_tokens=kept)
        return permuted
    k = g.draw(st.sampled_from([d for d in (1, 2, 3) if r % d == 0]))
    return g.op(op_type, rows, g.ints(g.rng.permutation(r), np.int32), num_topk=k)


SFA_SHAPES = [dict(B=1, S1=3, S2=6, N1=2, D=4, D2=4, K=3, mode=0), dict(B=2, S1=2, S2=5, N1=2, N2=2, D=4, D2=4, K=2,
                                                                          mode=3, Dr=2),
              dict(B=1, S1=3, S2=8, N1=4, N2=2, D=6, D2=4, K=2, bs=2, mode=0),
              dict(layout="TND", N1=2, D=4, D2=4, K=3, tnd_q=[2, 4], tnd_kv=[3, 7], mode=3)]


def _attention(g: Gen):
    params = dict(g.draw(st.sampled_from(SFA_SHAPES)), sinks=g.draw(st.booleans()), seed=g.draw(st.integers(0, 99)))
    merge = params.get("D2") == params.get("D") and g.draw(st.booleans())
    case = AttentionCase(**params, kv_merge=merge)
    arrays = case.arrays()
    inputs = {}
    for name in ("query", "key", "value", "query_rope", "key_rope", "sinks"):
        if arrays[name] is not None:
            inputs[name] = g.input(arrays[name].shape, str(arrays[name].dtype), arrays[name])
    for name in ("sparse_indices", "actual_seq_lengths_query", "actual_seq_lengths_kv"):
        if arrays[name] is not None:
            inputs[name] = g.b.constant(g.name(name), arrays[name])
    if merge:
        inputs["value"] = inputs["key"]
    attrs = dict(case.forward_attrs(), return_softmax_lse=g.draw(st.booleans()))
    out = g.op("SparseFlashAttention", **inputs, **attrs)[0]
    return g.op("Cast", out, to=1)


def _cast(g: Gen):
    a = g.pick()
    middle = g.op("Cast", a, to=g.draw(st.sampled_from([10, 16])))     # float16, bfloat16 and back (unrounded in the reference)
    return g.op("Cast", middle, to=1)


def _shape_op(g: Gen, op_type: str):
    a = g.pick()
    rank = len(a.type.shape)
    if op_type == "Transpose":
        perm = g.draw(st.permutations(range(rank)))
        return g.op("Transpose", a, perm=list(perm)) if rank and g.draw(st.booleans()) else g.op("Transpose", a)
    if op_type == "Reshape":
        return g.op("Reshape", a, g.ints(_reshape_target(g, a.type.shape)))
    if op_type == "Flatten":
        return g.op("Flatten", a, axis=g.draw(st.integers(-rank, rank))) if rank else None
    if op_type == "Squeeze":
        ones = [i for i, d in enumerate(a.type.shape) if d == 1]
        if not ones or g.draw(st.booleans()):
            return g.op("Squeeze", a)                 # every dim of size 1
        return g.op("Squeeze", a, g.ints([i - rank if g.draw(st.booleans()) else i for i in ones]))
    if op_type == "Unsqueeze":
        axis = g.draw(st.integers(-(rank + 1), rank)) if rank < 4 else None
        return None if axis is None else g.op("Unsqueeze", a, g.ints([axis]))
    if op_type in ("Softmax", "LogSoftmax"):
        return g.op(op_type, a, axis=g.draw(st.integers(-rank, rank - 1))) if rank else None
    if op_type == "Concat":
        if not rank:
            return None
        axis = g.draw(st.integers(-rank, rank - 1))
        other_shape = list(a.type.shape)
        other_shape[axis] = g.draw(st.integers(1, 3))
        other = a if g.draw(st.booleans()) else g.input(other_shape)
        if _size(a.type.shape) + _size(other.type.shape) > MAX_SIZE:
            return None
        return g.op("Concat", *((a, other) if g.draw(st.booleans()) else (other, a)), axis=axis)
    return g.op(op_type, a)          # Neg, Identity


POSITIVE_ONLY = ("Log", "Sqrt", "Reciprocal")
"""Elementwise ops generated on inputs fed [0.5, 1.5] (their derivatives blow up at 0)."""
NEWER_OPSETS = {"Gelu": 20, "RMSNormalization": 23}
"""Standard ops newer than the builder's default opset: added at their own."""


def _newer(g: Gen, op_type: str, *inputs, **attrs):
    """A standard node at the opset that defines it (``b.op`` adds standard ops at geir's default opset)."""
    g.ops.add(op_type)
    schema = get_schema(op_type, "", version=NEWER_OPSETS[op_type])
    return g.b.add_node(schema, list(inputs), attrs)


def _positive(g: Gen, shape=None):
    """An input fed [0.5, 1.5] (a new one of ``shape``, or one there is)."""
    if shape is None and g.positive and g.draw(st.booleans()):
        return g.draw(st.sampled_from(g.positive))
    return g.input(shape if shape is not None else (2, 3))


def _elementwise(g: Gen, op_type: str):
    if op_type in POSITIVE_ONLY:
        return g.op(op_type, _positive(g))
    a = g.pick()
    if op_type == "Exp":     # keep its values where float64 central differences are accurate
        a = g.op("Tanh", a)
    if op_type == "LeakyRelu":
        return g.op(op_type, a, alpha=g.draw(st.sampled_from([0.01, 0.2, 1.5])))
    if op_type == "Gelu":
        return _newer(g, "Gelu", a, approximate=g.draw(st.sampled_from(["none", "tanh"])))
    return g.op(op_type, a)


def _pow(g: Gen):
    base = _positive(g)
    kind = g.draw(st.sampled_from(["square", "int", "float", "input"]))
    if kind == "square":
        exponent = g.ints(2.0, np.float32)
    elif kind == "int":
        exponent = g.ints(g.draw(st.sampled_from([-1, 3])))
    elif kind == "float":
        exponent = g.ints(g.rng.uniform(-1.5, 2.5, _broadcast_partner(g, base.type.shape)), np.float32)
    else:
        exponent = g.input(_broadcast_partner(g, base.type.shape))     # differentiated too
    return g.op("Pow", base, exponent)


def _clip(g: Gen):
    a = g.pick()
    bounds = []
    for low in (True, False):
        kind = g.draw(st.sampled_from(["none", "constant", "input"]))
        if kind == "none":
            bounds.append(None)
        elif kind == "constant":
            bounds.append(g.ints(np.float32(g.rng.uniform(0.3, 0.9) if low else g.rng.uniform(0.8, 1.4)), np.float32))
        else:
            bounds.append(g.input(()))
    return g.op("Clip", a, *bounds)


def _variadic(g: Gen, op_type: str):
    a = g.pick()
    operands = [a] + [a if g.draw(st.booleans()) and g.draw(st.booleans())
                      else g.input(_broadcast_partner(g, a.type.shape)) for _ in range(g.draw(st.integers(1, 2)))]
    return g.op(op_type, *g.draw(st.permutations(operands)))


def _where(g: Gen):
    a = g.pick()
    other = g.input(_broadcast_partner(g, a.type.shape))
    condition = g.ints(g.rng.integers(0, 2, _broadcast_partner(g, a.type.shape)).astype(bool), bool)
    return g.op("Where", condition, *((a, other) if g.draw(st.booleans()) else (other, a)))


def _expand(g: Gen):
    a = g.pick()
    target = [d if d != 1 else g.draw(st.sampled_from([1, 2, 3])) for d in a.type.shape]
    if g.draw(st.booleans()) and _size(target) * 2 <= MAX_SIZE and len(target) < 4:
        target = [2] + target
    if _size(target) > MAX_SIZE:
        return None
    given = [1 if g.draw(st.booleans()) and d == a.type.shape[i - len(target) + len(a.type.shape)] else d
             for i, d in enumerate(target)] if len(target) == len(a.type.shape) else target
    return g.op("Expand", a, g.ints(given))


def _split(g: Gen):
    a = g.pick(1)
    rank = len(a.type.shape)
    axis = g.draw(st.integers(-rank, rank - 1))
    size = a.type.shape[axis]
    if size < 2:
        return None
    first = g.draw(st.integers(1, size - 1))
    pieces = g.op("Split", a, g.ints([first, size - first]), axis=axis)
    kept = [p for p in pieces if g.draw(st.booleans())] or [pieces[0]]     # a piece nobody reads gets no cotangent
    g.values.extend(kept[:-1])
    return kept[-1]


def _gemm(g: Gen):
    a = g.pick(2)
    if a is None:
        return None
    m = a.type.shape[0]
    k = _size(a.type.shape) // m
    a2 = g.op("Reshape", a, g.ints([m, k]))
    trans_a, trans_b = g.draw(st.sampled_from([0, 1])), g.draw(st.sampled_from([0, 1]))
    if trans_a:
        a2 = g.op("Transpose", a2, perm=[1, 0])
    n = g.draw(st.integers(1, 3))
    b = g.input((n, k) if trans_b else (k, n))
    c = g.input(g.draw(st.sampled_from([(m, n), (n,), (1, n), (m, 1), ()]))) if g.draw(st.booleans()) else None
    return g.op("Gemm", a2, b, c, alpha=g.draw(st.sampled_from([1.0, 0.5])), beta=g.draw(st.sampled_from([1.0, 2.0])),
                transA=trans_a, transB=trans_b)


def _gather_nd(g: Gen):
    a = g.pick(1)
    shape = a.type.shape
    k = g.draw(st.integers(1, len(shape)))
    batch = tuple(g.draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    indices = np.stack([g.rng.integers(-d, d, batch) for d in shape[:k]], axis=-1)
    return g.op("GatherND", a, g.ints(indices))


def _element_indices(g: Gen, shape: tuple, axis: int, distinct: bool):
    """GatherElements' / ScatterElements' indices: the data's rank, other dims no larger than the data's."""
    size = shape[axis]
    dims = [g.draw(st.integers(1, d)) if i != axis else g.draw(st.integers(1, size if distinct else 3))
            for i, d in enumerate(shape)]
    if distinct:       # each target written once: a permutation's prefix along the axis
        order = np.argsort(g.rng.random(tuple(d if i != axis else size for i, d in enumerate(dims))), axis=axis)
        index = np.take(order, np.arange(dims[axis]), axis=axis)
        return np.where(g.rng.random(index.shape) < 0.5, index - size, index)
    return g.rng.integers(-size, size, dims)


def _gather_elements(g: Gen):
    a = g.pick(1)
    axis = g.draw(st.integers(0, len(a.type.shape) - 1))
    return g.op("GatherElements", a, g.ints(_element_indices(g, a.type.shape, axis, False)), axis=axis)


def _top_k(g: Gen):
    a = g.pick(1)
    rank = len(a.type.shape)
    axis = g.draw(st.integers(-rank, rank - 1))
    k = g.draw(st.integers(1, a.type.shape[axis]))
    values, _ = g.op("TopK", a, g.ints([k]), axis=axis, largest=g.draw(st.sampled_from([0, 1])),
                     sorted=g.draw(st.sampled_from([0, 1])))
    return values


def _scatter(g: Gen, op_type: str):
    a = g.pick(1)
    reduction = g.draw(st.sampled_from(["none", "add"]))
    if op_type == "ScatterElements":
        axis = g.draw(st.integers(0, len(a.type.shape) - 1))
        indices = _element_indices(g, a.type.shape, axis, reduction == "none")
        return g.op(op_type, a, g.ints(indices), g.input(indices.shape), axis=axis, reduction=reduction)
    shape = a.type.shape
    k = g.draw(st.integers(1, len(shape)))
    cells = [np.unravel_index(i, shape[:k]) for i in g.rng.permutation(_size(shape[:k]))]
    count = g.draw(st.integers(1, len(cells)))
    chosen = cells[:count] if reduction == "none" else [cells[i] for i in g.rng.integers(0, len(cells), count)]
    indices = np.asarray(chosen, np.int64).reshape(count, k)
    return g.op(op_type, a, g.ints(indices), g.input((count,) + tuple(shape[k:])), reduction=reduction)


def _tile(g: Gen):
    a = g.pick(1)
    repeats = [g.draw(st.integers(1, 2)) for _ in a.type.shape]
    return g.op("Tile", a, g.ints(repeats)) if _size(a.type.shape) * _size(repeats) <= MAX_SIZE else None


def _pad(g: Gen):
    a = g.pick(1)
    shape = a.type.shape
    mode = g.draw(st.sampled_from(["constant", "constant", "reflect", "edge", "wrap"]))
    rank = len(shape)
    axes = g.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))

    def amount(d):         # onnx.reference pads with np.pad, which takes no negative pads (cropping)
        return g.draw(st.integers(0, min(2, d - 1 if mode == "reflect" else 2)))
    pads = [amount(shape[ax]) for ax in axes] + [amount(shape[ax]) for ax in axes]
    if _size(shape) * 4 > MAX_SIZE * 2:
        return None
    given_axes = g.ints(axes) if g.draw(st.booleans()) or len(axes) < rank else None
    if given_axes is None:
        order = np.argsort(axes)
        pads = [pads[i] for i in order] + [pads[len(axes) + i] for i in order]
    value = g.ints(np.float32(0.25), np.float32) if mode == "constant" and g.draw(st.booleans()) else None
    return g.op("Pad", a, g.ints(pads), value, given_axes, mode=mode)


def _trilu(g: Gen):
    a = g.pick(2)
    if a is None:
        return None
    k = g.ints(g.draw(st.integers(-2, 2))) if g.draw(st.booleans()) else None
    return g.op("Trilu", a, k, upper=g.draw(st.sampled_from([0, 1])))


def _cumsum(g: Gen):
    a = g.pick(1)
    rank = len(a.type.shape)
    return g.op("CumSum", a, g.ints(g.draw(st.integers(-rank, rank - 1))), exclusive=g.draw(st.sampled_from([0, 1])),
                reverse=g.draw(st.sampled_from([0, 1])))


def _einsum(g: Gen):
    a = g.pick(1)
    rank = len(a.type.shape)
    letters = "abcd"[:rank]
    shared = [ch for ch in letters if g.draw(st.booleans())] or [letters[-1]]
    other = "".join(shared) + "z"
    sizes = dict(zip(letters, a.type.shape), z=g.draw(st.integers(1, 3)))
    pool = sorted(set(letters) | set(other))
    out = "".join(g.draw(st.permutations([ch for ch in pool if g.draw(st.booleans())])))
    left = letters
    if g.draw(st.booleans()) and rank > 1:          # an ellipsis for a's leading dims, kept in the output
        lead = letters[:-1]
        left = "..." + letters[-1]
        other = "".join(ch for ch in other if ch not in lead) or "z"
        out = "..." + "".join(ch for ch in out if ch not in lead)
    equation = f"{left},{other}->{out}" if g.draw(st.sampled_from([True, True, False])) else f"{left},{other}"
    b = g.input(tuple(sizes[ch] for ch in other))
    return g.op("Einsum", a, b, equation=equation)


def _layer_norm(g: Gen, op_type: str):
    a = g.pick(1)
    rank = len(a.type.shape)
    axis = g.draw(st.integers(-rank, rank - 1))
    normalized = a.type.shape[axis:]
    if _size(normalized) < 2:
        return None
    scale = g.input(normalized)      # onnx.reference normalises with a scale of the normalized shape only
    eps = g.draw(st.sampled_from([1e-5, 0.1]))
    if op_type == "RMSNormalization":
        return _newer(g, op_type, a, scale, axis=axis, epsilon=eps)
    bias = g.input(normalized) if g.draw(st.booleans()) else None
    statistics = g.draw(st.booleans())
    results = g.op(op_type, a, scale, bias, axis=axis, epsilon=eps, outputs=3 if statistics else 1)
    if statistics:
        g.values.extend(v for v in results[1:] if g.draw(st.booleans()))
        return results[0]
    return results


def _batch_norm(g: Gen):
    a = g.pick(2)
    if a is None:
        return None
    c = a.type.shape[1]
    scale, bias, mean = (g.input((c,)) for _ in range(3))
    return g.op("BatchNormalization", a, scale, bias, mean, _positive(g, (c,)), epsilon=1e-2, outputs=1)


def _dropout(g: Gen):
    a = g.pick()
    training = g.draw(st.booleans())
    ratio = g.ints(np.float32(g.draw(st.sampled_from([0.0, 0.3]))), np.float32)
    out = g.op("Dropout", a, ratio, g.ints(np.bool_(training), bool), seed=g.draw(st.integers(0, 9)),
               outputs=g.draw(st.sampled_from([1, 2])))
    return out[0] if isinstance(out, tuple) else out


def _reduce(g: Gen, op_type: str):
    a = g.pick()
    rank = len(a.type.shape)
    keep = g.draw(st.sampled_from([0, 1]))
    if rank == 0 or g.draw(st.booleans()):
        return g.op(op_type, a, keepdims=keep, noop_with_empty_axes=g.draw(st.sampled_from([0, 1])))
    axes = g.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    return g.op(op_type, a, g.ints([ax - rank if g.draw(st.booleans()) else ax for ax in axes]), keepdims=keep)


REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceMax",
              "ReduceMin", "ReduceProd")

BUILDERS: dict[str, Callable] = {
    **{op: (lambda g, op=op: _binary(g, op)) for op in ("Add", "Sub", "Mul", "Div")},
    **{op: (lambda g, op=op: _elementwise(g, op)) for op in ("Exp", "Log", "Sqrt", "Reciprocal", "Tanh", "Sigmoid",
                                                             "Relu", "Abs", "LeakyRelu", "Erf", "Gelu", "Softplus",
                                                             "Sin", "Cos", "Sign", "Floor", "Ceil", "Round")},
    **{op: (lambda g, op=op: _shape_op(g, op)) for op in ("Neg", "Identity", "Transpose", "Reshape", "Flatten",
                                                          "Squeeze", "Unsqueeze", "Softmax", "LogSoftmax", "Concat")},
    **{op: (lambda g, op=op: _variadic(g, op)) for op in ("Max", "Min", "Sum", "Mean")},
    **{op: (lambda g, op=op: _reduce(g, op)) for op in REDUCTIONS},
    **{op: (lambda g, op=op: _scatter(g, op)) for op in ("ScatterElements", "ScatterND")},
    **{op: (lambda g, op=op: _layer_norm(g, op)) for op in ("LayerNormalization", "RMSNormalization")},
    "MatMul": _matmul, "Slice": _slice, "Gather": _gather, "Cast": _cast, "Pow": _pow, "Clip": _clip,
    "Where": _where, "Expand": _expand, "Split": _split, "Gemm": _gemm, "GatherND": _gather_nd,
    "GatherElements": _gather_elements, "TopK": _top_k, "Tile": _tile, "Pad": _pad, "Trilu": _trilu,
    "CumSum": _cumsum, "Einsum": _einsum, "BatchNormalization": _batch_norm, "Dropout": _dropout,
    "InplacePartialRotaryMul": lambda g: _rotary(g, "InplacePartialRotaryMul"),
    "InplacePartialRotaryMulGrad": lambda g: _rotary(g, "InplacePartialRotaryMulGrad"),
    "MoeTokenUnpermute": lambda g: _moe(g, "MoeTokenUnpermute"),
    "MoeTokenUnpermuteGrad": lambda g: _moe(g, "MoeTokenUnpermuteGrad"),
    "MoeTokenPermute": lambda g: _moe_permute(g, "MoeTokenPermute"),
    "MoeTokenPermuteGrad": lambda g: _moe_permute(g, "MoeTokenPermuteGrad"),
    "SparseFlashAttention": _attention,
}


WEIGHTED = sorted(BUILDERS) + ["Slice", "Gather", "InplacePartialRotaryMul", "MoeTokenUnpermute", "Concat"]
"""The ops drawn: rules that place or gather elements are drawn twice as often (index bugs hide there)."""


def random_graph(draw, first: str | None = None) -> tuple[geir.Graph, dict, list[str] | None, set[str]]:
    """A built graph of 1-5 random ops over float32 inputs (the first one ``first`` when given), its feeds, the wrt
    subset (None: all) and its ops."""
    g = Gen(draw=draw, rng=np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1))))
    g.values.append(g.input(tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))))
    for step in range(draw(st.integers(1, 5))):
        op_type = first if step == 0 and first is not None else draw(st.sampled_from(WEIGHTED))
        value = BUILDERS[op_type](g)
        if value is not None and 0 < _size(value.type.shape) <= MAX_SIZE:
            g.values.append(value)
    # every value no node reads is an output, so each op lies on the way to one; sometimes an input passes through
    outputs = [v for v in g.values if not v.uses and v.producer is not None]
    if not outputs or draw(st.booleans()):
        outputs.append(g.values[0])
    for i, value in enumerate(outputs):
        g.b.output(value, None if value.producer is None else f"out{i}")
    graph = g.b.build()
    floating = [v.name for v in graph.inputs]
    wrt = None if draw(st.booleans()) else draw(st.lists(st.sampled_from(floating), min_size=1, unique=True))
    return graph, g.feeds, wrt, g.ops


def check_against_central_differences(graph: geir.Graph, feeds: dict, wrt: list[str] | None, seed: int = 0) -> None:
    """<u, J v> of the derivative graph equals the central difference of <u, f> in a random direction v."""
    rng = np.random.default_rng(seed)
    derivative = geir.grad(graph, wrt=wrt)
    names = [v.name for v in graph.inputs if wrt is None or v.name in wrt]
    outputs = list(graph.outputs)
    cotangent_inputs = derivative.inputs[len(graph.inputs):]
    assert len(cotangent_inputs) == len(outputs)
    u = {c.name: rng.standard_normal(v.type.shape) for c, v in zip(cotangent_inputs, outputs)}
    base = {k: np.asarray(a, np.float64) for k, a in feeds.items()}
    got = reference(derivative, {**base, **u}, rounded=False)
    direction = {k: rng.standard_normal(base[k].shape) for k in names}
    shifted = [reference(graph, {**base, **{k: base[k] + sign * EPS * direction[k] for k in names}}, rounded=False)
               for sign in (1, -1)]
    fd = sum(np.sum(u[c.name] * (shifted[0][v.name] - shifted[1][v.name])) / (2 * EPS)
             for c, v in zip(cotangent_inputs, outputs))
    analytic = sum(np.sum(got[f"grad_{k}"] * direction[k]) for k in names)
    scale = max(abs(fd), abs(analytic), 1e-3)
    # the difference quotient's own rounding error: each output's float64 error, magnified by 1 / (2 EPS)
    noise = sum(np.sum(np.abs(u[c.name]) * (np.abs(shifted[0][v.name]) + np.abs(shifted[1][v.name])))
                for c, v in zip(cotangent_inputs, outputs)) * np.finfo(np.float64).eps / (2 * EPS)
    assert abs(fd - analytic) <= 1e-6 * scale + 8 * noise, (fd, analytic, noise, [n.op_type for n in graph.nodes])
    # the derivative also runs on the NumPy runtime (float32 and narrower inside: a loose bound, and every shape)
    fed = {**feeds, **{c.name: u[c.name].astype(c.dtype.numpy) for c in cotangent_inputs}}
    ran = geir.run(derivative, fed, runtime="numpy")
    for name, want in got.items():
        have = np.asarray(ran[name], np.float64)
        assert have.shape == want.shape, name
        np.testing.assert_allclose(have, want, rtol=5e-2, atol=5e-2 * (1 + np.abs(want).max(initial=0)), err_msg=name)


def _property(data, first: str | None = None) -> None:
    graph, feeds, wrt, ops = random_graph(data.draw, first)
    assume(first is None or first in ops)       # the op could not read the input drawn (MatMul of a vector, ...)
    check_against_central_differences(graph, feeds, wrt)
    for op in ops:
        COUNTS[op] = COUNTS.get(op, 0) + 1
    COUNTS["graphs"] = COUNTS.get("graphs", 0) + 1


SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def test_every_op_with_a_vjp_rule_is_generated():
    """The generator covers every op that has a rule (a new rule without a generator fails here)."""
    assert set(vjp_ops()) <= set(BUILDERS), sorted(set(vjp_ops()) - set(BUILDERS))


@pytest.mark.parametrize("first", sorted(BUILDERS))
@settings(max_examples=6, **SETTINGS)
@given(data=st.data())
def test_grad_of_random_graphs_starting_with_each_op(first, data):
    _property(data, first)


@settings(max_examples=100, **SETTINGS)
@given(st.data())
def test_grad_of_random_graphs_matches_central_differences(data):
    _property(data)


@pytest.mark.slow
@settings(max_examples=1500, **SETTINGS)
@given(st.data())
def test_grad_of_random_graphs_matches_central_differences_long(data):
    _property(data)
