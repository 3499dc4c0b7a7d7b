"""SparseFlashAttention and SparseFlashAttentionGrad (spec section 4).

Each query row attends only to the key blocks listed in ``sparse_indices`` (DeepSeek-V3.2
style MLA: a shared KV head, an optional rope part), optionally bottom-right causal
(``sparse_mode`` 3). The grad recomputes probabilities from the saved softmax max and sum.
Layouts: BSND (B, S, N, D) and TND (tokens of all batches, N, D) with cumulative lengths.
"""

from __future__ import annotations

import math

import numpy as np

from ...ir._dtypes import DType
from ...ir._types import Dim, TensorType

from .._registry import register
from .._schema import AttrKind, AttrSpec, DataContext, InferContext, InputSpec, OpSchema, OutputSpec
from .selection import query_rows

__all__ = ["FORWARD", "GRAD", "INT64_MAX", "attention_layout", "head_group", "role_sizes"]

F16, BF16, F32, I32 = DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.INT32
INT64_MAX = 9223372036854775807
INT32_MAX = 2147483647
LAYOUTS = ("BSND", "TND")

# The symbolic role of each dim of each tensor, per layout (spec 4.2).
_ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    "query": {"BSND": ("B", "S1", "N1", "D"), "TND": ("T1", "N1", "D")},
    "query_rope": {"BSND": ("B", "S1", "N1", "Dr"), "TND": ("T1", "N1", "Dr")},
    "key": {"BSND": ("B", "S2", "N2", "D"), "TND": ("T2", "N2", "D")},
    "key_rope": {"BSND": ("B", "S2", "N2", "Dr"), "TND": ("T2", "N2", "Dr")},
    "value": {"BSND": ("B", "S2", "N2", "D2"), "TND": ("T2", "N2", "D2")},
    "sparse_indices": {"BSND": ("B", "S1", "N2", "K"), "TND": ("T1", "N2", "K")},
    "d_out": {"BSND": ("B", "S1", "N1", "D2"), "TND": ("T1", "N1", "D2")},
    "out": {"BSND": ("B", "S1", "N1", "D2"), "TND": ("T1", "N1", "D2")},
}
# Where each role is bound first (the tensor that defines it), in order of preference.
_SOURCES = {"B": "query", "S1": "query", "T1": "query", "N1": "query", "D": "query", "S2": "key", "T2": "key",
            "N2": "key", "Dr": "query_rope", "K": "sparse_indices"}
_RULE_OF_ROLE = {"D": "SA-S5", "Dr": "SA-S6", "D2": "SG-S11"}
_TENSORS = ("query", "key", "value", "sparse_indices", "d_out", "out", "query_rope", "key_rope")


def attention_layout(ctx: InferContext | DataContext) -> str:
    return ctx.attr("layout_query") if "layout_query" in ctx.attributes else ctx.attr("layout")


def head_group(n1: Dim, n2: Dim) -> Dim:
    """G = N1 / N2, or a derived symbol while either is symbolic."""
    if isinstance(n1, int) and isinstance(n2, int):
        return n1 // n2 if n2 else 0
    return 1 if n1 == n2 else f"G_{n1}_{n2}"


def _present(ctx: InferContext, name: str) -> TensorType | None:
    return ctx.input(name) if name in ctx.schema.input_names else None


def _role_sources(ctx: InferContext, layout: str) -> dict[str, tuple[Dim, str, int]]:
    """Each role's size, with the tensor and dim that define it."""
    sources = dict(_SOURCES, D2="d_out" if ctx.schema is GRAD else "value")
    bound: dict[str, tuple[Dim, str, int]] = {}
    for role, name in sources.items():
        t = _present(ctx, name)
        if t is not None and role in _ROLES[name][layout]:
            k = _ROLES[name][layout].index(role)
            bound[role] = (t.shape[k], name, k)
    return bound


def role_sizes(ctx: InferContext) -> dict[str, Dim]:
    """Sizes of the roles (B, S1, N1, D, S2, N2, D2, Dr, K, T1, T2) of a node that passed its checks.

    TND's B is the length of the cumulative length tensors.
    """
    layout = attention_layout(ctx)
    sizes = {role: size for role, (size, _, _) in _role_sources(ctx, layout).items()}
    lengths = ctx.input("actual_seq_lengths_query")
    if layout == "TND" and lengths is not None:
        sizes["B"] = lengths.shape[0]
    return sizes


def _bind_roles(ctx: InferContext, layout: str) -> dict[str, Dim]:
    """Bind every role to its size in its defining tensor; check every other tensor against it."""
    bound = _role_sources(ctx, layout)
    for name in _TENSORS:
        t = _present(ctx, name)
        if t is None:
            continue
        for k, role in enumerate(_ROLES[name][layout]):
            size, source, source_dim = bound[role]
            if (source, source_dim) == (name, k):
                continue
            ctx.require(ctx.equal(t.shape[k], size), _RULE_OF_ROLE.get(role, "SA-S3"), ctx.input_subject(name, k),
                        f"{size} ({role}, dim {source_dim} of {ctx.input_subject(source)})", t.shape[k],
                        "the key head dim must equal the query's D" if role == "D" else None)
    return {role: size for role, (size, _, _) in bound.items()}


def _check_lengths(ctx: InferContext, layout: str, batch: Dim, is_grad: bool) -> None:
    names = ("actual_seq_lengths_query", "actual_seq_lengths_kv")
    lengths = [ctx.input(n) for n in names]
    if layout == "TND":
        for n, t in zip(names, lengths):
            ctx.require(t is not None, "SA-S7", ctx.input_subject(n), "a cumulative length tensor (TND needs both)",
                        "None")
            ctx.require(t.rank == 1, "SA-S7", ctx.input_subject(n), "rank 1 (B,)", f"rank {t.rank}")
        ctx.require(ctx.equal(lengths[0].shape[0], lengths[1].shape[0]), "SA-S7", ctx.input_subject(names[1], 0),
                    f"{lengths[0].shape[0]} (B, the length of input {ctx.schema.input_index(names[0])} '{names[0]}')",
                    lengths[1].shape[0])
        ctx.require(lengths[0].shape[0] != 0, "SA-S7", ctx.input_subject(names[0], 0), "B >= 1", 0)
        return
    for n, t in zip(names, lengths):
        if t is None:
            continue
        rule = "SA-S7c" if is_grad else "SA-S7b"
        ctx.require(t.rank == 1, rule, ctx.input_subject(n), "rank 1 (B,)", f"rank {t.rank}")
        if is_grad:
            ctx.warn("SG-W1", ctx.input_subject(n), "no length tensor with layout BSND", "one",
                     "the grad ignores BSND lengths (as CANN does); the forward honours them")
        else:
            ctx.require(ctx.equal(t.shape[0], batch), rule, ctx.input_subject(n, 0), f"{batch} (B)", t.shape[0],
                        "a length-1 tensor is not broadcast (CANN's tiling needs one length per batch)")


def _check(ctx: InferContext) -> None:
    is_grad = ctx.schema is GRAD
    if is_grad:
        layout = ctx.attr("layout")
        ctx.require(layout in LAYOUTS, "SA-S1", ctx.attr_subject("layout"), "BSND or TND", repr(layout))
    else:
        layout, layout_kv = ctx.attr("layout_query"), ctx.attr("layout_kv")
        ctx.require(layout in LAYOUTS, "SA-S1", ctx.attr_subject("layout_query"), "BSND or TND", repr(layout))
        ctx.require(layout_kv in LAYOUTS + ("PA_BSND",), "SA-S1", ctx.attr_subject("layout_kv"),
                    "BSND, TND or PA_BSND", repr(layout_kv))
        ctx.require(layout_kv != "PA_BSND", "SA-S1b", ctx.attr_subject("layout_kv"), "BSND or TND", "'PA_BSND'",
                    "layout_kv=PA_BSND (paged KV cache with block_table) is not supported yet")
        ctx.require(layout_kv == layout, "SA-S1c", ctx.attr_subject("layout_kv"),
                    f"{layout!r} (layout_query; CANN needs them equal)", repr(layout_kv))
        ctx.require(ctx.input("block_table") is None, "SF-S10", ctx.input_subject("block_table"), "None",
                    "a tensor", "block_table is only meaningful with layout_kv=PA_BSND")
    mode, block, scale = ctx.attr("sparse_mode"), ctx.attr("sparse_block_size"), ctx.attr("scale_value")
    ctx.require(mode in (0, 3), "SA-S8", ctx.attr_subject("sparse_mode"), "0 (no mask) or 3 (bottom-right causal)",
                mode)
    ctx.require(block >= 1, "SA-S8", ctx.attr_subject("sparse_block_size"), ">= 1", block)
    with np.errstate(over="ignore"):
        finite = math.isfinite(np.float32(scale))
    ctx.require(finite, "SA-S8", ctx.attr_subject("scale_value"),
                "a finite float32", scale)
    rank = 4 if layout == "BSND" else 3
    for name in _TENSORS:
        t = _present(ctx, name)
        if t is not None:
            ctx.require(t.rank == rank, "SA-S2", ctx.input_subject(name), f"rank {rank} (layout {layout})",
                        f"rank {t.rank} (shape {t})")
    q_rope, k_rope = ctx.input("query_rope"), ctx.input("key_rope")
    if (q_rope is None) != (k_rope is None):
        missing = "query_rope" if q_rope is None else "key_rope"
        ctx.fail("SA-S6", ctx.input_subject(missing), "a tensor (query_rope and key_rope come together)", "None")
    bound = _bind_roles(ctx, layout)
    n1, n2 = bound["N1"], bound["N2"]
    if isinstance(n1, int) and isinstance(n2, int) and n2:
        ctx.require(n1 % n2 == 0, "SA-S4", ctx.input_subject("query", rank - 2),
                    f"a multiple of N2 = {n2} (dim {rank - 2} of input 1 'key')", n1)
    d, d2 = bound["D"], bound["D2"]
    ctx.require(d2 <= d if isinstance(d, int) and isinstance(d2, int) else None, "SA-S5",
                ctx.input_subject("d_out" if is_grad else "value", rank - 1), f"<= D = {d} (D2 <= D)", d2)
    _check_lengths(ctx, layout, bound.get("B"), is_grad)
    for i, t in enumerate(ctx.inputs):
        if t is not None and not ctx.schema.inputs[i].name.startswith("actual_seq_lengths"):
            for k, size in enumerate(t.shape):
                ctx.require(size != 0, "SA-S9", ctx.input_subject(i, k), "a non-zero extent", 0,
                            "CANN's tiling rejects empty tensors")
    stats_shape = (bound["B"], n2, bound["S1"], head_group(n1, n2)) if layout == "BSND" else (
        n2, bound["T1"], head_group(n1, n2))
    if is_grad:
        _check_grad_extras(ctx, stats_shape)
    else:
        sinks = ctx.input("sinks")
        if sinks is not None:
            ctx.require(sinks.rank == 1 and ctx.equal(sinks.shape[0], n1) is not False, "SF-S11",
                        ctx.input_subject("sinks"), f"shape ({n1},) (N1)", list(sinks.shape))
        for attr in ("pre_tokens", "next_tokens"):
            if ctx.attr(attr) != INT64_MAX:
                ctx.warn("SF-W1", ctx.attr_subject(attr), f"{INT64_MAX} (INT64_MAX)", ctx.attr(attr),
                         "ignored by the reference semantics")


def _check_grad_extras(ctx: InferContext, stats_shape: tuple[Dim, ...]) -> None:
    for name in ("softmax_max", "softmax_sum"):
        t = ctx.input(name)
        same = len(t.shape) == len(stats_shape) and all(ctx.equal(a, b) is not False for a, b in zip(t.shape, stats_shape))
        ctx.require(same, "SG-S10", ctx.input_subject(name), f"shape {list(stats_shape)} (B, N2, S1, G) or "
                    f"(N2, T1, G)", list(t.shape))


def _forward_infer(ctx: InferContext) -> None:
    query, value = ctx.input("query"), ctx.input("value")
    ctx.set_output(0, query.with_shape(query.shape[:-1] + (value.shape[-1],)))
    if ctx.attr("return_softmax_lse"):
        key = ctx.input("key")
        n1, n2 = query.shape[-2], key.shape[-2]
        stats = ((query.shape[0], n2, query.shape[1], head_group(n1, n2)) if ctx.attr("layout_query") == "BSND"
                 else (n2, query.shape[0], head_group(n1, n2)))
    else:
        stats = (0,)
    ctx.set_output(1, TensorType(F32, stats))
    ctx.set_output(2, TensorType(F32, stats))


def _grad_infer(ctx: InferContext) -> None:
    for out_index, name in enumerate(("query", "key", "value", "query_rope", "key_rope")):
        t = ctx.input(name)
        if t is not None:
            ctx.set_output(out_index, t)


def _validate(ctx: DataContext) -> None:
    """SA-D1 / SF-D2 (lengths), then SA-D3 (the block ids of every row the op reads)."""
    is_grad = ctx.schema is GRAD
    layout = attention_layout(ctx)
    query, key, indices = ctx.array("query"), ctx.array("key"), ctx.array("sparse_indices")
    lengths = [ctx.array("actual_seq_lengths_query"), ctx.array("actual_seq_lengths_kv")]
    names = ("actual_seq_lengths_query", "actual_seq_lengths_kv")
    if layout == "TND":
        for name, values, limit, what in zip(names, lengths, (query.shape[0], key.shape[0]), ("T1", "T2")):
            _check_cumulative(ctx, name, values, limit, what)
        seq_q = seq_kv = 0
    else:
        seq_q, seq_kv = query.shape[1], key.shape[1]
        if is_grad:
            lengths = [None, None]
        for name, values, limit, what in zip(names, lengths, (seq_q, seq_kv), ("S1", "S2")):
            if values is not None:
                bad = np.flatnonzero((values < 0) | (values > limit))
                if bad.size:
                    b = int(bad[0])
                    ctx.fail("SF-D2", f"{ctx.input_subject(name)} position {b}", f"a length in [0, {limit}] ({what})",
                             int(values[b]))
    rows_total = query.shape[0] * (seq_q if layout == "BSND" else 1)
    rows = query_rows(layout, rows_total, seq_q, seq_kv, lengths[0], lengths[1], ctx.attr("sparse_mode"))
    read = np.flatnonzero(rows.reads)
    if read.size == 0:
        return
    block = ctx.attr("sparse_block_size")
    entries = indices.reshape(rows_total, indices.shape[-2], indices.shape[-1])[read]
    blocks_available = (-(-rows.s2_len[read] // block))[:, None, None]
    is_pad = entries == -1
    out_of_range = ~is_pad & ((entries < 0) | (entries >= blocks_available))
    pad_inside = ~is_pad & (np.cumsum(is_pad, axis=-1) > 0)
    order = np.argsort(entries, axis=-1, kind="stable")
    ordered = np.take_along_axis(entries, order, axis=-1)
    repeat_sorted = np.zeros_like(is_pad)
    repeat_sorted[..., 1:] = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != -1)
    repeated = np.zeros_like(is_pad)
    np.put_along_axis(repeated, order, repeat_sorted, axis=-1)
    bad = out_of_range | pad_inside | repeated
    if not bad.any():
        return
    r, n2, i = (int(v) for v in np.argwhere(bad)[0])
    row, value, nb = int(read[r]), int(entries[r, n2, i]), int(blocks_available[r, 0, 0])
    if layout == "BSND":
        where = f"row (b={row // seq_q}, s1={row % seq_q}, n2={n2})"
    else:
        where = f"row (t={row}, n2={n2})"
    subject = f"{ctx.input_subject('sparse_indices')} {where} entry {i}"
    if out_of_range[r, n2, i]:
        ctx.fail("SA-D3", subject, f"-1 or a block id in [0, {nb}) (NB_b = ceil(S2b / {block}))", value)
    if pad_inside[r, n2, i]:
        ctx.fail("SA-D3", subject, "-1 (padding only after the last valid block id)", value)
    first = int(np.flatnonzero(entries[r, n2] == value)[0])
    ctx.fail("SA-D3", subject, f"a block id not listed before (NB_b = {nb})", f"{value}, already at entry {first}")


def _check_cumulative(ctx: DataContext, name: str, values: np.ndarray, limit: int, what: str) -> None:
    subject = ctx.input_subject(name)
    if values[0] < 0:
        ctx.fail("SA-D1", f"{subject} position 0", "a first cumulative length >= 0", int(values[0]))
    drops = np.flatnonzero(np.diff(values.astype(np.int64)) < 0)
    if drops.size:
        b = int(drops[0]) + 1
        ctx.fail("SA-D1", f"{subject} position {b}", f"a non-decreasing value (>= {int(values[b - 1])})",
                 int(values[b]))
    if values[-1] > limit:
        ctx.fail("SA-D1", f"{subject} position {values.size - 1}", f"a last value <= {limit} ({what})",
                 int(values[-1]))


_FLOATS = (F16, BF16)


def _combos(names: tuple[str, ...]) -> tuple[tuple[DType | None, ...], ...]:
    fixed = {"sparse_indices": I32, "block_table": I32, "actual_seq_lengths_query": I32,
             "actual_seq_lengths_kv": I32, "softmax_max": F32, "softmax_sum": F32, "sinks": F32}
    return tuple(tuple(fixed.get(n, dt) for n in names) for dt in _FLOATS)


# Inputs and attributes both ops declare alike.
_QUERY = InputSpec("query", _FLOATS, doc="(B, S1, N1, D) or (T1, N1, D)")
_KEY = InputSpec("key", _FLOATS, doc="(B, S2, N2, D) or (T2, N2, D)")
_INDICES = InputSpec("sparse_indices", (I32,), doc="(B, S1, N2, K) or (T1, N2, K): key block ids, -1 padded")
_ROPE = (InputSpec("query_rope", _FLOATS, optional=True, doc="(B, S1, N1, Dr) or (T1, N1, Dr)"),
         InputSpec("key_rope", _FLOATS, optional=True, doc="(B, S2, N2, Dr) or (T2, N2, Dr)"))
_SCALE = AttrSpec("scale_value", AttrKind.FLOAT, doc="score scale (float32)")
_BLOCK = AttrSpec("sparse_block_size", AttrKind.INT, 1, "keys per block id")
_MODE = AttrSpec("sparse_mode", AttrKind.INT, 3, "0: no mask, 3: bottom-right causal")


def _lengths(doc: str) -> tuple[InputSpec, InputSpec]:
    return (InputSpec("actual_seq_lengths_query", (I32,), optional=True, doc=doc),
            InputSpec("actual_seq_lengths_kv", (I32,), optional=True, doc=doc))


_FWD_INPUTS = (
    _QUERY, _KEY,
    InputSpec("value", _FLOATS, doc="(B, S2, N2, D2) or (T2, N2, D2)"),
    _INDICES,
    InputSpec("block_table", (I32,), optional=True, doc="paged KV cache (PA_BSND only; not supported yet)"),
    *_lengths("(B,): per batch (BSND) or cumulative (TND)"),
    *_ROPE,
    InputSpec("sinks", (F32,), optional=True, doc="(N1,): per-head attention sink logits"),
)
_GRAD_INPUTS = (
    _QUERY, _KEY, _INDICES,
    InputSpec("d_out", _FLOATS, doc="gradient of attention_out: (B, S1, N1, D2) or (T1, N1, D2)"),
    InputSpec("out", _FLOATS, doc="the forward's attention_out"),
    InputSpec("softmax_max", (F32,), doc="(B, N2, S1, G) or (N2, T1, G) from the forward"),
    InputSpec("softmax_sum", (F32,), doc="same shape as softmax_max"),
    InputSpec("value", _FLOATS, optional=True, doc="absent: KV merge, V = key[..., :D2]"),
    *_lengths("TND: cumulative; BSND: ignored (SG-W1)"),
    *_ROPE,
)
_VALIDATED = ("sparse_indices", "actual_seq_lengths_query", "actual_seq_lengths_kv")

FORWARD = register(OpSchema(
    op_type="SparseFlashAttention",
    inputs=_FWD_INPUTS,
    outputs=(OutputSpec("attention_out", doc="query's shape with last dim D2"),
             OutputSpec("softmax_max", doc="float32 (B, N2, S1, G) / (N2, T1, G), or (0,) without return_softmax_lse"),
             OutputSpec("softmax_sum", doc="same shape as softmax_max")),
    attributes=(
        _SCALE,
        _BLOCK,
        AttrSpec("layout_query", AttrKind.STRING, "BSND", "BSND or TND"),
        AttrSpec("layout_kv", AttrKind.STRING, "BSND", "must equal layout_query (PA_BSND not supported yet)"),
        _MODE,
        AttrSpec("pre_tokens", AttrKind.INT, INT64_MAX, "ignored (must stay INT64_MAX on devices)"),
        AttrSpec("next_tokens", AttrKind.INT, INT64_MAX, "ignored (must stay INT64_MAX on devices)"),
        AttrSpec("attention_mode", AttrKind.INT, 0, "devices need 2; no effect on the math"),
        AttrSpec("return_softmax_lse", AttrKind.BOOL, False, "output softmax_max/softmax_sum"),
    ),
    type_combinations=_combos(tuple(s.name for s in _FWD_INPUTS)),
    infer=_forward_infer,
    check=_check,
    validate=_validate,
    validated_inputs=_VALIDATED,
    doc="Attention of each query row over the key blocks its sparse_indices list.",
))

GRAD = register(OpSchema(
    op_type="SparseFlashAttentionGrad",
    inputs=_GRAD_INPUTS,
    outputs=(OutputSpec("d_query"), OutputSpec("d_key"),
             OutputSpec("d_value", optional=True, doc="present iff value is"),
             OutputSpec("d_query_rope", optional=True, doc="present iff the rope inputs are"),
             OutputSpec("d_key_rope", optional=True, doc="present iff the rope inputs are")),
    attributes=(
        _SCALE,
        _BLOCK,
        AttrSpec("layout", AttrKind.STRING, "BSND", "BSND or TND"),
        _MODE,
        AttrSpec("pre_tokens", AttrKind.INT, INT32_MAX, "ignored"),
        AttrSpec("next_tokens", AttrKind.INT, INT32_MAX, "ignored"),
        AttrSpec("deterministic", AttrKind.BOOL, False, "ignored (device determinism is a context flag)"),
    ),
    type_combinations=_combos(tuple(s.name for s in _GRAD_INPUTS)),
    infer=_grad_infer,
    check=_check,
    validate=_validate,
    validated_inputs=_VALIDATED,
    doc="Gradients of SparseFlashAttention w.r.t. query, key, value and the rope parts.",
))
