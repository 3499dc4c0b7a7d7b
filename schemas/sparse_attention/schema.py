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

from ...ir._registry import register
from ...ir._schema import AttrKind, AttrSpec, InferContext, InputSpec, OpSchema, OutputSpec
from .layouts import LAYOUTS, PAGED, attention_layout, is_paged
from .validation import validate

__all__ = ["FORWARD", "GRAD", "INT64_MAX", "PAGED", "attention_layout", "head_group", "is_paged", "role_sizes"]

F16, BF16, F32, I32 = DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.INT32
INT64_MAX = 9223372036854775807
INT32_MAX = 2147483647

# The symbolic role of each dim of each tensor, per layout (spec 4.2).
_ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    "query": {"BSND": ("B", "S1", "N1", "D"), "TND": ("T1", "N1", "D")},
    "query_rope": {"BSND": ("B", "S1", "N1", "Dr"), "TND": ("T1", "N1", "Dr")},
    "key": {"BSND": ("B", "S2", "N2", "D"), "TND": ("T2", "N2", "D"), "PA": ("BN", "PG", "N2", "D")},
    "key_rope": {"BSND": ("B", "S2", "N2", "Dr"), "TND": ("T2", "N2", "Dr"), "PA": ("BN", "PG", "N2", "Dr")},
    "value": {"BSND": ("B", "S2", "N2", "D2"), "TND": ("T2", "N2", "D2"), "PA": ("BN", "PG", "N2", "D2")},
    "sparse_indices": {"BSND": ("B", "S1", "N2", "K"), "TND": ("T1", "N2", "K")},
    "d_out": {"BSND": ("B", "S1", "N1", "D2"), "TND": ("T1", "N1", "D2")},
    "out": {"BSND": ("B", "S1", "N1", "D2"), "TND": ("T1", "N1", "D2")},
}
# Where each role is bound first (the tensor that defines it), in order of preference. A paged cache
# (layout_kv PA_BSND, spec 4.11) holds key/value/key_rope as (block_num BN, page PG, N2, .).
_SOURCES = {"B": "query", "S1": "query", "T1": "query", "N1": "query", "D": "query", "S2": "key", "T2": "key",
            "N2": "key", "Dr": "query_rope", "K": "sparse_indices", "BN": "key", "PG": "key"}
_RULE_OF_ROLE = {"D": "SA-S5", "Dr": "SA-S6", "D2": "SG-S11", "BN": "PA-S1", "PG": "PA-S1"}
_KV_TENSORS = ("key", "value", "key_rope")
_TENSORS = ("query", "key", "value", "sparse_indices", "d_out", "out", "query_rope", "key_rope")


def head_group(n1: Dim, n2: Dim) -> Dim:
    """G = N1 / N2, or a derived symbol while either is symbolic."""
    if isinstance(n1, int) and isinstance(n2, int):
        return n1 // n2 if n2 else 0
    return 1 if n1 == n2 else f"G_{n1}_{n2}"


def _present(ctx: InferContext, name: str) -> TensorType | None:
    return ctx.input(name) if name in ctx.schema.input_names else None


def _layout_of(ctx: InferContext, name: str, layout: str) -> str:
    return "PA" if name in _KV_TENSORS and is_paged(ctx) else layout


def _role_sources(ctx: InferContext, layout: str) -> dict[str, tuple[Dim, str, int]]:
    """Each role's size, with the tensor and dim that define it."""
    sources = dict(_SOURCES, D2="d_out" if ctx.schema is GRAD else "value")
    bound: dict[str, tuple[Dim, str, int]] = {}
    for role, name in sources.items():
        t = _present(ctx, name)
        roles = _ROLES[name].get(_layout_of(ctx, name, layout), ())
        if t is not None and role in roles:
            k = roles.index(role)
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
    table = ctx.input("block_table") if "block_table" in ctx.schema.input_names else None
    if is_paged(ctx) and table is not None and isinstance(table.shape[1], int) and isinstance(sizes.get("PG"), int):
        sizes["S2"] = table.shape[1] * sizes["PG"]        # the nominal S2 of a paged cache: max_blocks * page
    return sizes


def _bind_roles(ctx: InferContext, layout: str) -> dict[str, Dim]:
    """Bind every role to its size in its defining tensor; check every other tensor against it."""
    bound = _role_sources(ctx, layout)
    for name in _TENSORS:
        t = _present(ctx, name)
        if t is None:
            continue
        for k, role in enumerate(_ROLES[name][_layout_of(ctx, name, layout)]):
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
        ctx.require(layout_kv in LAYOUTS + (PAGED,), "SA-S1", ctx.attr_subject("layout_kv"),
                    "BSND, TND or PA_BSND", repr(layout_kv))
        if layout_kv == PAGED:
            _check_paged_inputs(ctx)
        else:
            ctx.require(layout_kv == layout, "SA-S1c", ctx.attr_subject("layout_kv"),
                        f"{layout!r} (layout_query, or 'PA_BSND' for a paged cache; CANN needs them equal)",
                        repr(layout_kv))
            ctx.require(ctx.input("block_table") is None, "PA-S2", ctx.input_subject("block_table"), "None",
                        "a tensor", "block_table is only read with layout_kv=PA_BSND (a paged KV cache)")
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
        if t is not None and _layout_of(ctx, name, layout) == "PA":
            ctx.require(t.rank == 4, "PA-S1", ctx.input_subject(name), "rank 4 (block_num, page, N2, dim) of a paged "
                        "cache", f"rank {t.rank} (shape {t})")
        elif t is not None:
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
    if not is_grad and is_paged(ctx):
        _check_paged_shapes(ctx, layout, bound)
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


def _check_paged_inputs(ctx: InferContext) -> None:
    """PA-S2, PA-S3, PA-S5: what a paged cache needs before any shape is compared (spec 4.11)."""
    table, lengths = ctx.input("block_table"), ctx.input("actual_seq_lengths_kv")
    ctx.require(table is not None, "PA-S2", ctx.input_subject("block_table"), "a (B, max_blocks) int32 table "
                "(layout_kv PA_BSND reads the cache through it)", "None")
    ctx.require(table.rank == 2, "PA-S2", ctx.input_subject("block_table"), "rank 2 (B, max_blocks)",
                f"rank {table.rank} (shape {table})")
    ctx.require(lengths is not None, "PA-S3", ctx.input_subject("actual_seq_lengths_kv"),
                "a (B,) tensor of per-batch key counts (required with layout_kv PA_BSND)", "None")
    ctx.require(not ctx.attr("return_softmax_lse"), "PA-S5", ctx.attr_subject("return_softmax_lse"), "False",
                True, "layout_kv 'PA_BSND' returns no softmax statistics (CANN's tiling: 'When return_softmax_lse "
                "is true, layout_kv does not support PA_BSND')")


def _check_paged_shapes(ctx: InferContext, layout: str, bound: dict[str, Dim]) -> None:
    """PA-S2..S4 on the bound sizes: one table row and one key count per batch, a legal page size."""
    table, lengths = ctx.input("block_table"), ctx.input("actual_seq_lengths_kv")
    batch = bound["B"] if layout == "BSND" else ctx.input("actual_seq_lengths_query").shape[0]
    batch_source = "B, dim 0 of input 0 'query'" if layout == "BSND" else "B, the length of actual_seq_lengths_query"
    ctx.require(ctx.equal(table.shape[0], batch), "PA-S2", ctx.input_subject("block_table", 0),
                f"{batch} ({batch_source})", table.shape[0])
    ctx.require(table.shape[1] != 0, "PA-S2", ctx.input_subject("block_table", 1), ">= 1 (max_blocks)", 0)
    ctx.require(lengths.rank == 1 and ctx.equal(lengths.shape[0], batch) is not False, "PA-S3",
                ctx.input_subject("actual_seq_lengths_kv"), f"shape ({batch},) (one key count per batch, not "
                "cumulative)", list(lengths.shape))
    page, block = bound["PG"], ctx.attr("sparse_block_size")
    if isinstance(page, int):
        subject = ctx.input_subject("key", 1)
        ctx.require(0 < page <= 1024, "PA-S4", subject, "a page size in 1..1024", page)
        ctx.require(page % 16 == 0, "PA-S4", subject, "a page size divisible by 16", page)
        ctx.require(page % block == 0, "PA-S4", subject, f"a page size divisible by sparse_block_size = {block} "
                    "(a sparse block never spans two pages)", page)


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
    InputSpec("block_table", (I32,), optional=True, doc="(B, max_blocks) page ids of a paged KV cache (PA_BSND only)"),
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
        AttrSpec("layout_kv", AttrKind.STRING, "BSND", "layout_query's, or PA_BSND: a paged cache (spec 4.11)"),
        _MODE,
        AttrSpec("pre_tokens", AttrKind.INT, INT64_MAX, "ignored (must stay INT64_MAX on devices)"),
        AttrSpec("next_tokens", AttrKind.INT, INT64_MAX, "ignored (must stay INT64_MAX on devices)"),
        AttrSpec("attention_mode", AttrKind.INT, 0, "devices need 2; no effect on the math"),
        AttrSpec("return_softmax_lse", AttrKind.BOOL, False, "output softmax_max/softmax_sum"),
    ),
    type_combinations=_combos(tuple(s.name for s in _FWD_INPUTS)),
    infer=_forward_infer,
    check=_check,
    validate=validate,
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
    validate=validate,
    validated_inputs=_VALIDATED,
    doc="Gradients of SparseFlashAttention w.r.t. query, key, value and the rope parts.",
))
