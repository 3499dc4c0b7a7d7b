"""Every rewrite proves itself: for each fusion pattern, hypothesis builds the pattern and its near variants (axes,
split points, operand order, index dtypes, negative, repeated, out-of-range and fed indices, broadcasts, masks),
fuses them, and runs both graphs on random inputs: the float64 reference and both runtimes. By default
(``geir.fuse(graph)``) the fused graph must give the original's result (within the op's tolerance) or fail with an
ExecutionError where the original fails: nothing else. With ``allow_stricter_data=True`` it may also fail where the
input breaks a precondition the op states and checks at run time (a repeated key id, an MoE index that is no
permutation); it never returns a result where the original fails. The canonical form of each pattern must fuse
with ``allow_stricter_data``. Each example draws the mode. A derandomised handful runs by default; ``-m slow``
runs many more."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import geir
from geir.testing import reference

BIG = 2 ** 62
RUNTIMES = ("numpy", "onnxruntime")
TOLERANCE = {"float32": 1e-4, "float16": 2e-2}
"""Runtime against runtime (rounded in the input dtype, in another order inside our op); the float64 references
of both graphs agree to 1e-6 (the op's Float attributes are float32)."""
COUNTS: dict[str, list[int]] = {}
"""pattern -> [examples, variants that do not build, fused, input cases compared]: what the runs covered."""


@dataclass
class Case:
    graph: geir.Graph
    feeds: list[dict[str, np.ndarray]]
    canonical: bool
    """The pattern itself (must fuse)."""
    refusal_ok: Callable[[dict[str, np.ndarray]], bool] = lambda feeds: False
    """Whether the op may refuse these feeds where the original runs (its stated run-time precondition)."""
    special: bool = False
    """The feeds hold what the op defines otherwise than the subgraph (zero weights, non-finite rows): allowed
    stricter data, the fused graph may give the op's meaning there; by default it must give the subgraph's."""
    dtype: str = "float32"
    notes: list[str] = field(default_factory=list)


class _B:
    """A GraphBuilder with numbered int64 constants."""

    def __init__(self, name: str) -> None:
        self.b, self.n = geir.GraphBuilder(name), 0

    def ints(self, values, dtype=np.int64):
        self.n += 1
        return self.b.constant(f"c{self.n}", np.asarray(values, dtype))

    def slice(self, x, start, end, step=1):
        return self.b.op("Slice", x, self.ints([start]), self.ints([end]), self.ints([-1]), self.ints([step]))


def _rng(data) -> np.random.Generator:
    return np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))


def _normal(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# -- rope ------------------------------------------------------------------------------------------------------------
SHAPE = (2, 3, 2)


def _tables(data, d):
    """(table shape, legal for the op): the broadcasts RP-S8 allows, and near ones (rank 3, a last dim of 1)."""
    b, s, n = SHAPE
    table = data.draw(st.sampled_from([(1, s, 1, d), (b, s, n, d), (1, 1, 1, d), (b, 1, n, d)] * 2 + [(s, 1, d),
                                                                                                    (1, s, 1, 1)]),
                      label="table")
    return table, len(table) == 4 and table[-1] == d


def _rope_inputs(data, forward: bool):
    d = data.draw(st.sampled_from([4, 6, 8]), label="d")
    dtype = data.draw(st.sampled_from(["float32", "float16"]), label="dtype")
    table, legal = _tables(data, d)
    g = _B("rope")
    x = g.b.input("x", dtype, (*SHAPE, d))
    cos, sin = g.b.input("cos", dtype, table), g.b.input("sin", dtype, table)
    return g, x, cos, sin, d, dtype, legal


def _mul(data, g, a, b, label):
    return g.b.op("Mul", *((a, b) if data.draw(st.booleans(), label=label) else (b, a)))


def _halves(data, g, x, d):
    """x[..., :cut], x[..., cut:] by Slice or Split; whether cut is the middle."""
    cut = data.draw(st.sampled_from([d // 2] * 6 + [d // 2 - 1, d // 2 + 1]), label="cut")
    if data.draw(st.booleans(), label="split"):
        first, second = g.b.op("Split", x, g.ints([cut, d - cut]), axis=-1)
    else:
        first, second = g.slice(x, 0, cut), g.slice(x, cut, data.draw(st.sampled_from([BIG, d]), label="end"))
    return first, second, cut == d // 2


def _pair(data, g, x):
    """x[..., 1::2], x[..., 0::2] (or swapped starts, a near variant); whether canonical."""
    starts = data.draw(st.sampled_from([(1, 0)] * 6 + [(0, 1)]), label="starts")
    return g.slice(x, starts[0], BIG, 2), g.slice(x, starts[1], BIG, 2), starts == (1, 0)


def _stack(data, g, first, second, d):
    """Concat(Unsqueeze(first, a), Unsqueeze(second, a), -1) flattened to x's shape; whether a is the last axis."""
    axis = data.draw(st.sampled_from([-1, 4] * 2 + [3, -2, 0]), label="unsqueeze axis")
    parts = [g.b.op("Unsqueeze", v, g.ints([axis])) for v in (first, second)]
    target = data.draw(st.sampled_from([[*SHAPE, d], [0, 0, 0, -1]]), label="flatten target")
    return g.b.op("Reshape", g.b.op("Concat", *parts, axis=-1), g.ints(target)), axis in (-1, 4)


def _negated(data, g, a, b, label):
    """(Neg(a), b) in the canonical order, or a near variant: Neg on b, or the Concat order swapped."""
    where = data.draw(st.sampled_from(["a"] * 5 + ["b"]), label=f"{label} neg")
    order = data.draw(st.sampled_from([True] * 5 + [False]), label=f"{label} order")
    pieces = (g.b.op("Neg", a), b) if where == "a" else (a, g.b.op("Neg", b))
    return (pieces if order else pieces[::-1]), where == "a" and order


def _rope_case(data, kind: str) -> Case:
    forward = not kind.endswith("backward")
    g, x, cos, sin, d, dtype, legal = _rope_inputs(data, forward)
    source = x if forward else _mul(data, g, x, sin, "sin product order")
    if kind.startswith("half"):
        first, second, middle = _halves(data, g, source, d)
        # forward: cat(-x2, x1); backward: cat(m2, -m1)
        pieces, canonical = _negated(data, g, second, first, "half") if forward else \
            ((lambda p, c: (p[::-1], c))(*_negated(data, g, first, second, "half")))
        moved = g.b.op("Concat", *pieces, axis=-1)
        canonical = canonical and middle
    else:
        odd, even, ordered = _pair(data, g, source)
        pieces, canonical = _negated(data, g, odd, even, "pair") if forward else \
            ((lambda p, c: (p[::-1], c))(*_negated(data, g, even, odd, "pair")))
        moved, last = _stack(data, g, *pieces, d)
        canonical = canonical and ordered and last
    plain = _mul(data, g, x, cos, "cos product order")
    term = _mul(data, g, moved, sin, "sin product order") if forward else moved
    y = g.b.op("Add", *((plain, term) if data.draw(st.booleans(), label="add order") else (term, plain)))
    g.b.output(y, "y")
    rng = _rng(data)
    feeds = [{"x": _normal(rng, (*SHAPE, d), dtype), "cos": _normal(rng, cos.type.shape, dtype),
              "sin": _normal(rng, sin.type.shape, dtype)}]
    return Case(g.b.build(), feeds, canonical and legal and (kind.startswith("half") or d % 2 == 0), dtype=dtype)


def _half_width_case(data) -> Case:
    """cat(a * c - b * s, b * c + a * s) with half-width tables; near variants: a cut off the middle, the even and
    odd slices swapped, the sign on the other product, the pieces swapped, tables of full width or width 1."""
    d = data.draw(st.sampled_from([4, 6, 8]), label="d")
    dtype = data.draw(st.sampled_from(["float32", "float16"]), label="dtype")
    h = d // 2
    table, legal = _tables(data, h)
    table = (*table[:-1], data.draw(st.sampled_from([table[-1]] * 6 + [1, d]), label="table width"))
    legal = legal and table[-1] == h
    g = _B("half_width")
    nope = data.draw(st.sampled_from([0, 0, 2, 3]), label="pass-through width")   # MLA: cat(q_nope, terms)
    q = g.b.input("x", dtype, (*SHAPE, nope + d))
    cos, sin = g.b.input("cos", dtype, table), g.b.input("sin", dtype, table)
    if nope:
        kept, x = g.b.op("Split", q, g.ints([nope, d]), axis=-1)
    else:
        x = q
    if data.draw(st.booleans(), label="even and odd"):
        odd, even, ordered = _pair(data, g, x)
        a, b, canonical = even, odd, ordered
    else:
        a, b, canonical = _halves(data, g, x, d)
    flipped = data.draw(st.sampled_from([False] * 5 + [True]), label="sign on the other product")
    low = g.b.op("Add" if flipped else "Sub", _mul(data, g, a, cos, "a c"), _mul(data, g, b, sin, "b s"))
    high_terms = (_mul(data, g, b, cos, "b c"), _mul(data, g, a, sin, "a s"))
    high = g.b.op("Sub" if flipped else "Add", *(high_terms if data.draw(st.booleans(), label="add order")
                                                 else high_terms[::-1]))
    order = data.draw(st.sampled_from([True] * 5 + [False]), label="piece order")
    pieces = [low, high] if order else [high, low]
    kept_first = data.draw(st.sampled_from([True] * 5 + [False]), label="pass-through first")
    if nope:
        pieces = [kept, *pieces] if kept_first else [*pieces, kept]
        order = order and kept_first
    g.b.output(g.b.op("Concat", *pieces, axis=-1), "y")
    rng = _rng(data)
    feeds = [{"x": _normal(rng, (*SHAPE, nope + d), dtype), "cos": _normal(rng, table, dtype),
              "sin": _normal(rng, table, dtype)}]
    return Case(g.b.build(), feeds, canonical and legal and not flipped and order, dtype=dtype)


def _partial_case(data) -> Case:
    d = data.draw(st.sampled_from([8, 10, 12]), label="d")
    start = data.draw(st.sampled_from([0, 2, 3, 4]), label="start")
    stop = data.draw(st.sampled_from([s for s in (start + 4, start + 6, d) if s <= d and (s - start) % 2 == 0]),
                     label="stop")
    length = stop - start
    g = _B("partial")
    x = g.b.input("x", "float32", (*SHAPE, d))
    cos, sin = g.b.input("cos", "float32", (1, 3, 1, length)), g.b.input("sin", "float32", (1, 3, 1, length))
    by_split = data.draw(st.booleans(), label="pieces by one Split")
    if by_split:                          # MLA's (nope, pe) split: the pieces are the Split's outputs
        sizes = [n for n in (start, length, d - stop) if n]
        outs = g.b.op("Split", x, g.ints(sizes), axis=-1)
        part = outs[1 if start else 0]
    else:
        part = g.slice(x, start, stop)
    if data.draw(st.booleans(), label="interleaved"):
        odd, even = g.slice(part, 1, BIG, 2), g.slice(part, 0, BIG, 2)
        parts = [g.b.op("Unsqueeze", v, g.ints([-1])) for v in (g.b.op("Neg", odd), even)]
        rotated = g.b.op("Reshape", g.b.op("Concat", *parts, axis=-1), g.ints([*SHAPE, length]))
    else:
        h = length // 2
        rotated = g.b.op("Concat", g.b.op("Neg", g.slice(part, h, BIG)), g.slice(part, 0, h), axis=-1)
    roped = g.b.op("Add", g.b.op("Mul", part, cos), g.b.op("Mul", rotated, sin))
    gap = data.draw(st.sampled_from([0, 0, 0, 1]), label="suffix gap")          # 1: a piece is missing
    order = data.draw(st.sampled_from([True, True, True, False]), label="piece order")
    if by_split:
        gap = 0
        pieces = ([outs[0]] if start else []) + [roped] + ([outs[-1]] if stop < d else [])
    else:
        pieces = ([g.slice(x, 0, start)] if start else []) + [roped] + \
            ([g.slice(x, stop + gap, BIG)] if stop + gap < d else [])
    g.b.output(g.b.op("Concat", *(pieces if order else pieces[::-1]), axis=-1), "y")
    rng = _rng(data)
    feeds = [{"x": _normal(rng, (*SHAPE, d), np.float32), "cos": _normal(rng, (1, 3, 1, length), np.float32),
              "sin": _normal(rng, (1, 3, 1, length), np.float32)}]
    return Case(g.b.build(), feeds, gap == 0 and (order or len(pieces) == 1))


# -- indices ---------------------------------------------------------------------------------------------------------
def _mutate(data, rng, ids: np.ndarray, size: int, huge: bool, label: str) -> np.ndarray:
    """A copy of ``ids`` with one drawn change: none, Gather's negative ids, a repeat, an id out of range, or (int64)
    one beyond int32."""
    ids = ids.astype(np.int64).copy()
    kind = data.draw(st.sampled_from(["none", "wrap", "wrap", "repeat", "out", "huge" if huge else "wrap"]), label=label)
    flat = ids.reshape(-1)
    at = rng.integers(flat.size)
    if kind == "wrap":
        flat[rng.random(flat.size) < 0.5] -= size
    elif kind == "repeat" and flat.size > 1:
        flat[at] = flat[(at + 1) % flat.size]
    elif kind == "out":
        flat[at] = rng.choice([size, -size - 1])
    elif kind == "huge":
        flat[at] = 2 ** 32 + flat[at]
    return ids


def _is_permutation(ids: np.ndarray, size: int, count: int) -> bool:
    ids = ids.astype(np.int64)
    ids = np.where((ids < 0) & (ids >= -size), ids + size, ids)
    return np.array_equal(np.sort(ids), np.arange(count))


# -- MoE unpermute ---------------------------------------------------------------------------------------------------
def _moe_case(data) -> Case:
    if data.draw(st.sampled_from([False, False, True]), label="slot-major rows"):
        return _moe_slot_major_case(data)
    tokens, topk, hidden = (data.draw(st.integers(1, 3), label=n) for n in ("T", "K", "H"))
    slots = tokens * topk
    scatter = data.draw(st.sampled_from([False, False, True]), label="scatter")
    rows = slots if scatter else max(1, slots + data.draw(st.sampled_from([0, 0, 1, -1]), label="rows - M"))
    index_dtype = data.draw(st.sampled_from(["int32", "int64"]), label="index dtype")
    fed = data.draw(st.booleans(), label="fed")
    probs_form = data.draw(st.sampled_from(["unsqueeze", "axis2", "reshape", "none"]), label="probs")
    axes = data.draw(st.sampled_from([[1], [1], [-2], [2]]), label="reduce axes")
    rng = _rng(data)
    g = _B("moe")
    permuted = g.b.input("permuted", "float32", (rows, hidden))
    constant = _mutate(data, rng, rng.permutation(slots), rows, index_dtype == "int64", "constant ids")
    idx = g.b.input("idx", index_dtype, (slots,)) if fed else g.b.constant("idx", constant.astype(index_dtype))
    if scatter:
        placed = g.b.op("ScatterND", g.b.constant("zeros", np.zeros((rows, hidden), np.float32)),
                        g.b.op("Unsqueeze", idx, g.ints([-1])), permuted)
    else:
        placed = g.b.op("Gather", permuted, idx, axis=0)
    summed = g.b.op("Reshape", placed, g.ints([tokens, topk, hidden]))
    if probs_form != "none":
        p = g.b.input("probs", "float32", (tokens, topk))
        shaped = g.b.op("Reshape", p, g.ints([tokens, topk, 1])) if probs_form == "reshape" else \
            g.b.op("Unsqueeze", p, g.ints([-1 if probs_form == "unsqueeze" else 2]))
        summed = _mul(data, g, summed, shaped, "probs order")
    g.b.output(g.b.op("ReduceSum", summed, g.ints(axes), keepdims=0), "y")
    feeds = []
    special = data.draw(st.booleans(), label="zero weights and non-finite rows")
    for i in range(2 if fed else 1):
        f = {"permuted": _normal(rng, (rows, hidden), np.float32)}
        if probs_form != "none":
            f["probs"] = rng.uniform(0.1, 1.0, (tokens, topk)).astype(np.float32)
        if special:
            f["permuted"].reshape(-1)[rng.integers(rows * hidden, size=2)] = [np.inf, np.nan]
            if probs_form != "none":
                f["probs"][rng.random((tokens, topk)) < 0.4] = 0.0
        if fed:
            ids = _mutate(data, rng, rng.permutation(slots), rows, index_dtype == "int64", f"fed ids {i}")
            f["idx"] = ids.astype(index_dtype)
        feeds.append(f)
    permutation = fed or _is_permutation(constant, rows, slots)    # a constant row2slot too (MU-D1)
    return Case(g.b.build(), feeds, rows >= slots and axes != [2] and permutation,
                refusal_ok=lambda f: not _is_permutation(f["idx"] if fed else constant, rows, slots), special=special)


def _moe_slot_major_case(data) -> Case:
    """transformers' batched experts: rows already in slot order times probs flattened to (T*K, 1), reshaped to
    (T, K, H) and summed over K; near variants: probs of shape (K, T) (another slot order unless K = T), probs
    transposed first (still row-major: the op reads the transposed values), a sum over another axis."""
    tokens, topk, hidden = (data.draw(st.integers(1, 3), label=n) for n in ("T", "K", "H"))
    slots = tokens * topk
    symbolic = data.draw(st.booleans(), label="symbolic T (a dynamic export)")
    g = _B("moe_slot_major")
    rows = g.b.input("rows", "float32", ("m" if symbolic else slots, hidden))
    layout = data.draw(st.sampled_from(["tk", "tk", "kt", "transposed"]), label="probs layout")
    t = "t" if symbolic else tokens
    p = g.b.input("probs", "float32", (topk, t) if layout != "tk" else (t, topk))
    source = g.b.op("Transpose", p, perm=[1, 0]) if layout == "transposed" else p
    if data.draw(st.booleans(), label="flatten then unsqueeze"):
        weights = g.b.op("Unsqueeze", g.b.op("Reshape", source, g.ints([-1 if symbolic else slots])), g.ints([-1]))
    else:
        weights = g.b.op("Reshape", source, g.ints([-1 if symbolic else slots, 1]))
    product = _mul(data, g, rows, weights, "weights order")
    axis = data.draw(st.sampled_from([1, 1, 1, 0]), label="reduce axis")
    g.b.output(g.b.op("ReduceSum", g.b.op("Reshape", product, g.ints([-1 if symbolic else tokens, topk, hidden])),
                      g.ints([axis]), keepdims=0), "y")
    rng = _rng(data)
    special = data.draw(st.booleans(), label="zero weights and non-finite rows")
    fed_rows = slots + (topk if symbolic and data.draw(st.booleans(), label="one token more rows") else 0)
    f = {"rows": _normal(rng, (fed_rows, hidden), np.float32),
         "probs": rng.uniform(0.1, 1.0, (topk, tokens) if layout != "tk" else (tokens, topk)).astype(np.float32)}
    if special:
        f["rows"].reshape(-1)[rng.integers(slots * hidden, size=2)] = [np.inf, np.nan]
        f["probs"][rng.random(f["probs"].shape) < 0.4] = 0.0
    canonical = axis == 1 and (layout != "kt" or tokens == topk and not symbolic) and not (symbolic and topk == 1)
    return Case(g.b.build(), [f], canonical, special=special)


# -- sparse attention ------------------------------------------------------------------------------------------------
PREDICATES = {"GreaterOrEqual": lambda a: a >= 0, "Greater": lambda a: a > -1, "Not": lambda a: a != -1}


def _moe_loop_case(data) -> Case:
    """The eager per-expert loop as TorchScript exports ``index_add_``: each expert's weighted rows scattered into
    zeros, the scatters added up from zeros. Near variants: tokens fed as they are (repeated within an expert,
    negative, out of range: the op's slots must resolve them as the scatter does, or refuse), one row scattered to
    many tokens through the Expand, -0 or non-zero scatter data or start, a reduction, float16, non-finite rows."""
    t, h = data.draw(st.integers(1, 4), label="T"), data.draw(st.integers(1, 3), label="H")
    experts = data.draw(st.integers(1, 3), label="experts")
    dtype = data.draw(st.sampled_from(["float32", "float32", "float16"]), label="dtype")
    tokens_from = data.draw(st.sampled_from(["routing", "routing", "fed"]), label="tokens")
    zeros = data.draw(st.sampled_from(["+0", "+0", "+0", "-0", "one"]), label="zeros")
    start = data.draw(st.sampled_from(["constant", "constant", "shape", "-0"]), label="start")
    reduction = data.draw(st.sampled_from(["none"] * 5 + ["add"]), label="reduction")
    expanded = data.draw(st.booleans(), label="rows through Expand")
    rng = _rng(data)
    np_dtype = np.dtype(dtype)
    g = _B("moe_loop")
    x = g.b.input("x", dtype, (t, h))
    ids = g.b.input("ids", "int64", (t,))
    fill = {"+0": 0.0, "-0": -0.0, "one": 1.0}[zeros]
    if start == "shape":
        total = g.b.op("ConstantOfShape", g.b.op("Shape", x), value=onnx.numpy_helper.from_array(
            np.zeros(1, np_dtype), "value"))
    else:
        total = g.b.constant("start", np.full((t, h), -0.0 if start == "-0" else 0.0, np_dtype))
    feeds_tokens = {}
    for e in range(experts):
        if tokens_from == "routing":
            tokens = g.b.op("Squeeze", g.b.op("NonZero", g.b.op("Equal", ids, g.ints(e))), g.ints([0]))
        else:
            count = data.draw(st.integers(0, 3), label=f"rows of expert {e}")
            feeds_tokens[f"tok{e}"] = np.array([data.draw(st.integers(-t - 1, t), label=f"token {e}.{r}")
                                                for r in range(count)], np.int64)
            tokens = g.b.input(f"tok{e}", "int64", (count,))
        if tokens_from == "fed" and data.draw(st.booleans(), label=f"rows of expert {e} fed"):
            out = g.b.input(f"rows{e}", dtype, (count, h))      # not gathered by the tokens: any id reaches the sum
            feeds_tokens[f"rows{e}"] = _normal(rng, (count, h), np_dtype)
        else:
            out = g.b.op("MatMul", g.b.op("Gather", x, tokens, axis=0),
                         g.b.constant(f"w{e}", rng.standard_normal((h, h)).astype(np_dtype)))
        if expanded:
            out = g.b.op("Expand", out, g.ints([1, h]))
        at = g.b.op("Expand", g.b.op("Unsqueeze", tokens, g.ints([1])), g.b.op("Shape", out))
        back = g.b.op("ScatterElements", g.b.constant(f"zeros{e}", np.full((t, h), fill, np_dtype)), at, out, axis=0,
                      **({"reduction": "add"} if reduction == "add" else {}))
        total = g.b.op("Add", total, back)
    g.b.output(total, "y")
    feeds = []
    for _ in range(2):
        x_value = _normal(rng, (t, h), np_dtype)
        if data.draw(st.booleans(), label="non-finite"):
            x_value[rng.integers(t), rng.integers(h)] = data.draw(st.sampled_from([np.inf, -np.inf, np.nan]))
        feeds.append({"x": x_value, "ids": rng.integers(0, experts, t).astype(np.int64), **feeds_tokens})
    canonical = dtype == "float32" and tokens_from == "routing" and zeros == "+0" and start == "constant" and \
        reduction == "none"
    return Case(g.b.build(), feeds, canonical=canonical, dtype=dtype,
                refusal_ok=lambda feeds: tokens_from == "fed")


def _keys_of(ids: np.ndarray, t2: int, mask: str | None) -> list[list[int]]:
    """The key ids each row reads in the subgraph's meaning."""
    ids = ids.astype(np.int64)
    if mask is None:
        ids = np.where((ids < 0) & (ids >= -t2), ids + t2, ids)
        return [list(r) for r in ids]
    valid = PREDICATES[mask](ids)
    return [list(np.maximum(r[v], 0)) for r, v in zip(ids, valid)]


def _has_repeat(ids: np.ndarray, t2: int, mask: str | None) -> bool:
    return any(len(set(r)) != len(r) for r in _keys_of(ids, t2, mask))


def _attention_ids(data, rng, t1, t2, k, mask, huge, label):
    ids = np.stack([rng.permutation(t2)[:k] for _ in range(t1)])
    ids = _mutate(data, rng, ids, t2, huge, label)
    if mask is not None and data.draw(st.booleans(), label=f"{label} padding"):
        ids[rng.random(ids.shape) < 0.4] = data.draw(st.sampled_from([-1, -1, -3]), label=f"{label} pad value")
        if data.draw(st.booleans(), label=f"{label} a row of padding"):
            ids[rng.integers(t1)] = -1
    return ids


def _attention_case(data) -> Case:
    t1, n1, t2 = data.draw(st.integers(1, 4), label="T1"), data.draw(st.integers(1, 4), label="N1"), \
        data.draw(st.integers(3, 6), label="T2")
    k, d2 = data.draw(st.integers(1, 3), label="K"), data.draw(st.sampled_from([2, 4]), label="D2")
    mask = data.draw(st.sampled_from([None, "GreaterOrEqual", "Greater", "Not"]), label="mask")
    unsqueeze = data.draw(st.sampled_from([1, -2, 1, None, 0]), label="mask unsqueeze axis")
    if unsqueeze is None and not (t1 == n1 or t1 == 1) or unsqueeze == 0 and not (t1 == n1 or n1 == 1 or t1 == 1):
        unsqueeze = 1                                  # would not broadcast: no graph to fuse
    index_dtype = data.draw(st.sampled_from(["int32", "int64"]), label="index dtype")
    fed = data.draw(st.booleans(), label="fed")
    scale_op, factor = data.draw(st.sampled_from([("Mul", 0.25), ("Mul", 0.5), ("Div", 2.0), ("Div", 3.0)]),
                                 label="scale")
    rng = _rng(data)
    g = _B("attention")
    q, key = g.b.input("q", "float16", (t1, n1, 4)), g.b.input("k", "float16", (t2, 4))
    value = g.b.input("v", "float16", (t2, d2))
    constant = _attention_ids(data, rng, t1, t2, k, mask, index_dtype == "int64", "constant ids")
    idx = g.b.input("idx", index_dtype, (t1, k)) if fed else g.b.constant("idx", constant.astype(index_dtype))
    zero = g.ints(0, index_dtype)
    rows = idx
    if mask is not None:
        rows = g.b.op("Relu", idx) if data.draw(st.booleans(), label="relu") else g.b.op("Max", idx, zero)
    gathered = g.b.op("Transpose", g.b.op("Gather", key, rows, axis=0), perm=[0, 2, 1])
    scores = g.b.op(scale_op, g.b.op("MatMul", q, gathered), g.b.constant("factor", np.array(factor, np.float16)))
    if mask is not None:
        valid = g.b.op("Not", g.b.op("Equal", idx, g.ints(-1, index_dtype))) if mask == "Not" else \
            g.b.op(mask, idx, zero if mask == "GreaterOrEqual" else g.ints(-1, index_dtype))
        if unsqueeze is not None:
            valid = g.b.op("Unsqueeze", valid, g.ints([unsqueeze]))
        scores = g.b.op("Where", valid, scores, g.b.constant("minus_inf", np.array(-np.inf, np.float16)))
    out = g.b.op("MatMul", g.b.op("Softmax", scores, axis=-1), g.b.op("Gather", value, rows, axis=0))
    g.b.output(out, "out")
    feeds = []
    special = data.draw(st.booleans(), label="a NaN value row")
    for i in range(2 if fed else 1):
        f = {"q": _normal(rng, (t1, n1, 4), np.float16), "k": _normal(rng, (t2, 4), np.float16),
             "v": _normal(rng, (t2, d2), np.float16)}
        if special:                          # row 0 is what a padded entry gathers
            f["v"][data.draw(st.sampled_from([0, 0, t2 - 1]), label="NaN row")] = np.nan
        if fed:
            ids = _attention_ids(data, rng, t1, t2, k, mask, index_dtype == "int64", f"fed ids {i}")
            f["idx"] = ids.astype(index_dtype)
        feeds.append(f)
    fine = fed or not _has_repeat(constant, t2, mask) and all(
        all(0 <= i < t2 for i in r) and r for r in _keys_of(constant, t2, mask))
    return Case(g.b.build(), feeds, fine and (mask is None or unsqueeze in (1, -2)),
                refusal_ok=lambda f: _has_repeat(f["idx"] if fed else constant, t2, mask), dtype="float16",
                special=special)


FLOAT, FLOAT16, INT32, INT64, BOOL = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.INT64,
                                      TensorProto.BOOL)


def _bool_tensor(value: bool) -> TensorProto:
    return helper.make_tensor("value", TensorProto.BOOL, [1], [value])


def _top_k_ids(scores: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """ONNX TopK's indices along the last axis (equal values: the lower index first), sorted."""
    order = np.argsort(-scores if largest else scores, axis=-1, kind="stable")
    return order[..., :k]


def _top_k_case(data) -> Case:
    """DeepSeek-V3.2's eager attention: TopK key ids scattered into a "not selected" mask that fills an additive
    causal mask (or the scores) before the softmax; near variants: another additive mask, unsqueeze axis, K, fill,
    more query rows than keys, the selection's polarity, a float32 softmax between Casts."""
    b, s = data.draw(st.integers(1, 2), label="B"), data.draw(st.integers(1, 4), label="S")
    t = data.draw(st.integers(max(1, s - 1), 6), label="T")
    n1 = data.draw(st.sampled_from([1, 2, 4]), label="N1")
    n2 = data.draw(st.sampled_from([n1, n1, 1]), label="N2")
    k, d2 = data.draw(st.integers(1, t), label="K"), data.draw(st.sampled_from([2, 4]), label="D2")
    form = data.draw(st.sampled_from(["additive", "additive", "fill scores", "fill scores + mask"]), label="form")
    near = data.draw(st.sampled_from(["none", "none", "none", "mask", "fill", "unsqueeze"]), label="near variant")
    mask = data.draw(st.sampled_from(["top-left", "window"]), label="additive mask") if near == "mask" else \
        data.draw(st.sampled_from(["causal", "causal", "none"]), label="additive mask")
    fill = -1e4 if near == "fill" else data.draw(st.sampled_from([-np.inf, float(np.finfo(np.float16).min)]),
                                                  label="fill")
    unsqueeze = 2 if near == "unsqueeze" else 1
    polarity = data.draw(st.booleans(), label="True where not selected")
    largest = data.draw(st.booleans(), label="TopK largest")
    casts = data.draw(st.sampled_from([[], [INT32, INT64], [INT64]]), label="id casts")
    float32_softmax = data.draw(st.booleans(), label="softmax in float32")
    scale_op, factor = data.draw(st.sampled_from([("Mul", 0.5), ("Div", 2.0)]), label="scale")
    rng = _rng(data)
    g = _B("top_k_attention")
    q = g.b.input("q", "float16", (b, n1, s, 4))
    key, value = g.b.input("k", "float16", (b, n2, t, 4)), g.b.input("v", "float16", (b, n2, t, d2))
    index_scores = g.b.input("r", "float16", (b, s, t))
    ids = g.b.op("TopK", index_scores, g.ints([k]), axis=-1, largest=int(largest), sorted=1)[1]
    for dtype in casts:
        ids = g.b.op("Cast", ids, to=dtype)
    source = data.draw(st.sampled_from(["constant", "ConstantOfShape", "cast"]), label="mask source")
    if source == "ConstantOfShape":
        data_ = g.b.op("ConstantOfShape", g.ints([b, s, t]), value=_bool_tensor(polarity))
    elif source == "cast":                             # ones cast to bool, as larger exports write it
        data_ = g.b.op("Cast", g.b.constant("everywhere", np.full((b, s, t), float(polarity), np.float32)), to=BOOL)
    else:
        data_ = g.b.constant("everywhere", np.full((b, s, t), polarity))
    updates = g.b.op("ConstantOfShape", g.ints([b, s, k]), value=_bool_tensor(not polarity))
    selection = g.b.op("Unsqueeze", g.b.op("ScatterElements", data_, g.b.op("Cast", ids, to=INT64), updates,
                                           axis=-1), g.ints([unsqueeze]))
    rows, cols = np.arange(s)[:, None], np.arange(t)[None, :]
    visible = {"causal": cols <= rows + t - s, "none": np.ones((s, t), bool), "top-left": cols <= rows,
               "window": (cols <= rows + t - s) & (cols > rows + t - s - 2)}[mask]
    additive = np.where(visible, 0.0, fill).astype(np.float16)[None, None]
    fill_value = g.b.constant("fill", np.array(fill, np.float16))
    scores = g.b.op(scale_op, g.b.op("MatMul", q, g.b.op("Transpose", key, perm=[0, 1, 3, 2])),
                    g.b.constant("factor", np.array(factor, np.float16)))

    def where(other):
        return g.b.op("Where", selection, fill_value, other) if polarity else \
            g.b.op("Where", selection, other, fill_value)
    if form == "additive":
        logits = g.b.op("Add", scores, where(g.b.constant("mask", additive)))
    elif form == "fill scores":
        logits, visible = where(scores), np.ones((s, t), bool)
    else:
        logits = where(g.b.op("Add", scores, g.b.constant("mask", additive)))
    if float32_softmax:
        probs = g.b.op("Cast", g.b.op("Softmax", g.b.op("Cast", logits, to=FLOAT), axis=-1), to=FLOAT16)
    else:
        probs = g.b.op("Softmax", logits, axis=-1)
    g.b.output(g.b.op("MatMul", probs, value), "out")
    feeds, special = [], False
    masked_indexer = data.draw(st.booleans(), label="indexer masks hidden keys")
    for _ in range(2):
        f = {"q": _normal(rng, (b, n1, s, 4), np.float16), "k": _normal(rng, (b, n2, t, 4), np.float16),
             "v": _normal(rng, (b, n2, t, d2), np.float16), "r": _normal(rng, (b, s, t), np.float16)}
        top = np.float16(60000 if largest else -60000)
        if masked_indexer:                                   # the indexer scores hidden keys lowest, as DSV3.2's
            f["r"] = np.where(np.broadcast_to(visible, (b, s, t)), f["r"], -top)
        else:                # any order, but one visible key first in each row that has one (the others anywhere)
            first = np.argmax(visible * rng.random((b, s, t)), axis=-1)
            np.put_along_axis(f["r"], first[..., None], np.where(visible.any(-1), top, f["r"][..., 0])[..., None],
                              axis=-1)
        if feeds and data.draw(st.sampled_from([False, False, True]), label="a non-finite key"):
            f["k"][..., rng.integers(t), 0] = rng.choice([np.inf, np.nan])
            special = True
        picked = _top_k_ids(f["r"].astype(np.float64), k, largest)
        seen = np.take_along_axis(np.broadcast_to(visible, (b, s, t)), picked, axis=-1)
        special |= bool((~seen.any(axis=-1)).any())         # a row with no visible selected key
        feeds.append(f)
    legal = unsqueeze == 1 and (form == "fill scores" or mask in ("causal", "none")) and \
        not (form != "fill scores" and mask == "causal" and s > t) and fill != -1e4
    return Case(g.b.build(), feeds, legal, dtype="float16", special=special)


def _permute_case(data) -> Case:
    """torch's ``tokens.index_select(0, argsort(ids.view(-1)) // topK)`` as exported (TopK ascending, a Div, or
    floor_divide's Div-and-correct form); near variants: another divisor, a descending or unsorted TopK, a TopK
    of fewer than all slots, ids of another token count. Ids tie often (a stable sort is what the op is)."""
    tokens, topk, hidden = (data.draw(st.integers(1, 4), label=n) for n in ("T", "K", "H"))
    slots = tokens * topk
    divisor = max(1, topk + data.draw(st.sampled_from([0, 0, 0, -1, 1]), label="divisor - K"))
    largest = data.draw(st.sampled_from([0, 0, 0, 1]), label="largest")
    sorted_ = data.draw(st.sampled_from([1, 1, 1, 0]), label="sorted")
    k = data.draw(st.sampled_from([slots, slots, slots, max(1, slots - 1)]), label="TopK k")
    floor_form = data.draw(st.booleans(), label="floor_divide")
    fed = data.draw(st.booleans(), label="fed ids")
    rng = _rng(data)
    g = _B("permute")
    x = g.b.input("x", "float32", (tokens, hidden))
    constant = rng.integers(0, 3, (tokens, topk)).astype(np.int64)
    ids = g.b.input("ids", "int64", (tokens, topk)) if fed else g.b.constant("ids", constant)
    _, order = g.b.op("TopK", g.b.op("Reshape", ids, g.ints([-1])), g.ints([k]), axis=-1, largest=largest,
                      sorted=sorted_)
    divide = g.ints([divisor])
    quotient = g.b.op("Div", order, divide)
    if floor_form:
        negative = g.b.op("Less", order, g.b.constant("zero", np.array(0, np.int64)))
        differ = g.b.op("Equal", negative, g.b.constant("d_nonneg", np.array(True)))
        remainder = g.b.op("Cast", g.b.op("Mod", order, divide, fmod=0), to=9)
        quotient = g.b.op("Sub", quotient, g.b.op("Cast", g.b.op("And", differ, remainder), to=7))
    g.b.output(g.b.op("Gather", x, quotient, axis=0), "y")
    feeds = []
    for _ in range(2 if fed else 1):
        f = {"x": _normal(rng, (tokens, hidden), np.float32)}
        if fed:
            f["ids"] = rng.integers(0, 3, (tokens, topk)).astype(np.int64)
        feeds.append(f)
    canonical = divisor == topk and largest == 0 and sorted_ == 1 and k == slots
    return Case(g.b.build(), feeds, canonical)


# -- the proof -------------------------------------------------------------------------------------------------------
CASES: dict[str, Callable] = {
    "rotary half": lambda data: _rope_case(data, "half"),
    "rotary interleaved": lambda data: _rope_case(data, "interleaved"),
    "rotary half-width tables": _half_width_case,
    "rotary half backward": lambda data: _rope_case(data, "half backward"),
    "rotary interleaved backward": lambda data: _rope_case(data, "interleaved backward"),
    "rotary partial": _partial_case,
    "MoE unpermute": _moe_case,
    "MoE per-expert loop": _moe_loop_case,
    "MoE permute": _permute_case,
    "sparse attention": _attention_case,
    "sparse attention top-k mask": _top_k_case,
}
"""A generator per registered pattern, keyed by the pattern's name up to its formula."""


def test_every_registered_pattern_has_a_property_case():
    """A pattern added to a family without a generator here fails (the design asks each rewrite for its proof)."""
    from geir.schemas.patterns import patterns

    assert {p.name.split(" (")[0] for p in patterns()} == set(CASES)


def _outcome(run: Callable[[], dict]) -> dict | geir.ExecutionError:
    try:
        return run()
    except geir.ExecutionError as exc:
        return exc


def _agree(want, got, case: Case, feeds, tolerance: float, where: str, stricter: bool) -> None:
    if isinstance(want, geir.ExecutionError):
        assert isinstance(got, geir.ExecutionError), f"{where}: the fused graph gives a result where the original " \
                                                     f"fails ({want})"
    elif isinstance(got, geir.ExecutionError):
        assert stricter and case.refusal_ok(feeds), f"{where}: the fused graph refuses what the original runs: {got}"
    elif not (stricter and case.special):
        for name in want:
            np.testing.assert_allclose(np.asarray(got[name], np.float64), np.asarray(want[name], np.float64),
                                       rtol=tolerance, atol=tolerance, err_msg=where)


@np.errstate(invalid="ignore", over="ignore")          # a softmax over -inf only is NaN, in both graphs
def _prove(pattern: str, case: Case, stricter: bool) -> None:
    fused, report = geir.fuse(case.graph, allow_stricter_data=stricter)
    ours = [n for n in fused.nodes if n.domain == "ai.cann" and n.name.startswith("fused_")]
    counts = COUNTS[pattern]
    counts[2] += bool(ours)
    if case.canonical and stricter:
        assert ours, f"{pattern}: the canonical form did not fuse:\n{report}\n{case.graph}"
    if not ours:
        return                                                    # nothing rewritten: nothing to prove
    for feeds in case.feeds:
        counts[3] += 1
        _agree(_outcome(lambda: reference(case.graph, feeds, rounded=False)),
               _outcome(lambda: reference(fused, feeds, rounded=False)), case, feeds, 1e-6, f"{pattern}, float64", stricter)
        for runtime in RUNTIMES:
            _agree(_outcome(lambda: geir.run(case.graph, feeds, runtime=runtime)),
                   _outcome(lambda: geir.run(fused, feeds, runtime=runtime)), case, feeds, TOLERANCE[case.dtype],
                   f"{pattern}, {runtime}", stricter)


QUICK = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=150, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck))


def _case(pattern: str, data) -> Case | None:
    """The drawn case, or None for a near variant that is no valid graph (a broadcast that fails, say)."""
    counts = COUNTS.setdefault(pattern, [0, 0, 0, 0])
    counts[0] += 1
    try:
        return CASES[pattern](data)
    except geir.GraphError:
        counts[1] += 1
        return None


@pytest.mark.parametrize("pattern", list(CASES))
@QUICK
@given(data=st.data())
def test_every_rewrite_proves_itself(pattern, data):
    case = _case(pattern, data)
    if case is not None:
        _prove(pattern, case, data.draw(st.booleans(), label="allow_stricter_data"))


@pytest.mark.slow
@pytest.mark.parametrize("pattern", list(CASES))
@LONG
@given(data=st.data())
def test_every_rewrite_proves_itself_at_length(pattern, data):
    case = _case(pattern, data)
    if case is not None:
        _prove(pattern, case, data.draw(st.booleans(), label="allow_stricter_data"))
