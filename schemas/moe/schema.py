"""MoeTokenUnpermute and MoeTokenUnpermuteGrad (spec section 3).

Forward: each token sums its K expert-output rows, taken from the expert-sorted tensor
``permuted_tokens`` and weighted by the routing probabilities. ``sorted_indices[t*K + k]``
is the row of ``permuted_tokens`` that holds slot (token t, choice k): slot -> row,
token-major (``geir.moe_indices`` converts from other frameworks' conventions).
"""

from __future__ import annotations

import numpy as np

from ...ir._dtypes import DType
from ...ir._types import Dim

from ...ir._registry import register
from ...ir._schema import AttrKind, AttrSpec, DataContext, InferContext, InputSpec, OpSchema, OutputSpec
from ..index_bounds import largest_unsigned

__all__ = ["FORWARD", "GRAD", "validate_sorted_indices"]

F16, F32, BF16, I32 = DType.FLOAT16, DType.FLOAT32, DType.BFLOAT16, DType.INT32
_FLOATS = (BF16, F16, F32)


def _product(a: Dim, b: Dim) -> Dim | None:
    return a * b if isinstance(a, int) and isinstance(b, int) else None


PADDED_MODE_HINT = ("ignored: the op computes as with padded_mode=False (CANN's A2/A3 tiling ignores it; "
                    "aclnn on ascend950 refuses it)")


def _warn_padded_mode(ctx: InferContext, rule: str) -> None:
    """MU-W1 / MG-W1 (were the errors MU-S3 / MG-S6 until issue 27, item 3): padded_mode=True is ignored.

    The reference semantics is what the kernels do: ops-transformer moe/moe_token_unpermute/op_host/
    moe_token_unpermute_tiling.cpp never reads the attribute, and moe_token_unpermute_grad_tiling.cpp reads it but
    sets ``paddedModeKey = 0`` (@c29bc106, 2025-11-15). Device rows: MU-T5 / MG-T3 (schemas/moe/targets.py).
    """
    if ctx.attr("padded_mode"):
        ctx.warn(rule, ctx.attr_subject("padded_mode"), "False", True, PADDED_MODE_HINT)


def is_bf16_tokens_f32_probs(ctx: InferContext) -> bool:
    """bfloat16 tokens with float32 probs: the grad's dtype pair that returns NaN on the device (MG-W2)."""
    tokens, probs = ctx.input("unpermuted_tokens_grad"), ctx.input("probs")
    return probs is not None and tokens.dtype == BF16 and probs.dtype == F32


BF16_F32_HINT = ("MoeTokenUnpermuteGrad returns NaN on ascend910b/ascend910_93 for this pair; cast probs to bfloat16, "
                 "or the tokens to float32, around the op (as MindSpeed and torchtitan-npu do)")


def _check_rank(ctx: InferContext, rule: str, key: str, rank: int, layout: str) -> None:
    t = ctx.input(key)
    if t is not None:
        ctx.require(t.rank == rank, rule, ctx.input_subject(key), f"rank {rank} {layout}", f"rank {t.rank} (shape {t})")


def _check_slot_count(ctx: InferContext, rule: str, m: Dim, tn: Dim, k: Dim) -> None:
    """``len(sorted_indices) == tokens * topK`` (deferred while a factor is symbolic)."""
    product = _product(tn, k)
    ok = ctx.equal(m, product) if product is not None else (ctx.equal(m, tn) if k == 1 else None)
    ctx.require(ok, rule, ctx.input_subject("sorted_indices", 0), f"tokens * topK = {tn} * {k} = "
                f"{product if product is not None else '?'} (one row index per slot)", m)


def _forward_check(ctx: InferContext) -> None:
    _check_rank(ctx, "MU-S1", "permuted_tokens", 2, "(rows, hidden)")
    _check_rank(ctx, "MU-S1", "sorted_indices", 1, "(tokens * topK,)")
    _check_rank(ctx, "MU-S1", "probs", 2, "(tokens, topK)")
    probs = ctx.input("probs")
    m = ctx.input("sorted_indices").shape[0]
    if probs is not None:
        _check_slot_count(ctx, "MU-S2", m, probs.shape[0], probs.shape[1])
    _warn_padded_mode(ctx, "MU-W1")


def _forward_infer(ctx: InferContext) -> None:
    tokens, probs = ctx.input("permuted_tokens"), ctx.input("probs")
    rows = probs.shape[0] if probs is not None else ctx.input("sorted_indices").shape[0]
    ctx.set_output(0, tokens.with_shape((rows, tokens.shape[1])))


def _grad_check(ctx: InferContext) -> None:
    _check_rank(ctx, "MG-S1", "unpermuted_tokens_grad", 2, "(tokens, hidden)")
    _check_rank(ctx, "MG-S1", "sorted_indices", 1, "(tokens * topK,)")
    _check_rank(ctx, "MG-S1", "probs", 2, "(tokens, topK)")
    _check_rank(ctx, "MG-S3", "permuted_tokens", 2, "(len(sorted_indices), hidden)")
    tn, hidden = ctx.input("unpermuted_tokens_grad").shape
    m = ctx.input("sorted_indices").shape[0]
    probs, tokens = ctx.input("probs"), ctx.input("permuted_tokens")
    k: Dim = 1
    if probs is not None:
        k = probs.shape[1]
        ctx.require(ctx.equal(probs.shape[0], tn), "MG-S1", ctx.input_subject("probs", 0),
                    f"{tn} (tokens, dim 0 of input 1 'unpermuted_tokens_grad')", probs.shape[0])
    _check_slot_count(ctx, "MG-S2", m, tn, k)
    if tokens is not None:
        for dim, (want, got) in enumerate(zip((m, hidden), tokens.shape)):
            what = ("len(sorted_indices)", "hidden size of input 1 'unpermuted_tokens_grad'")[dim]
            ctx.require(ctx.equal(got, want), "MG-S3", ctx.input_subject("permuted_tokens", dim),
                        f"{want} ({what})", got)
    ctx.require(probs is None or tokens is not None, "MG-S4", ctx.input_subject("permuted_tokens"),
                "a value when probs is given", "None", "probs_grad needs the permuted token rows")
    extents = [("unpermuted_tokens_grad", 0, tn), ("unpermuted_tokens_grad", 1, hidden), ("sorted_indices", 0, m)]
    if probs is not None:
        extents.append(("probs", 1, k))
    for key, dim, size in extents:
        ctx.require(size != 0, "MG-S5", ctx.input_subject(key, dim), "a non-zero extent", 0,
                    "CANN's tiling rejects empty tensors")
    _warn_padded_mode(ctx, "MG-W1")
    if is_bf16_tokens_f32_probs(ctx):
        ctx.warn("MG-W2", ctx.input_subject("probs"), "bfloat16 probs with bfloat16 tokens", "float32",
                 BF16_F32_HINT)


def _grad_infer(ctx: InferContext) -> None:
    grad, probs = ctx.input("unpermuted_tokens_grad"), ctx.input("probs")
    m = ctx.input("sorted_indices").shape[0]
    ctx.set_output(0, grad.with_shape((m, grad.shape[1])))
    ctx.set_output(1, probs if probs is not None else grad.with_shape((grad.shape[0], 1)))


def is_permutation(indices: np.ndarray) -> bool:
    """Whether a 1-D integer array holds each of ``0..M-1`` once, in two array operations past the range check
    (``index_bounds``): M values in [0, M), each slot counted once by bincount, are a permutation."""
    m = indices.shape[0]
    if largest_unsigned(indices) >= m:
        return m == 0
    return m == 0 or int(np.minimum.reduce(np.bincount(indices, minlength=m))) == 1


def validate_sorted_indices(ctx: DataContext, rule: str) -> None:
    """MU-D1 / MG-D1: ``sorted_indices`` is a permutation of ``0..M-1``; name the first offender."""
    indices = ctx.array("sorted_indices")
    m = indices.shape[0]
    if is_permutation(indices):
        return
    subject = ctx.input_subject("sorted_indices")
    out_of_range = (indices < 0) | (indices >= m)
    if out_of_range.any():
        pos = int(np.argmax(out_of_range))
        ctx.fail(rule, f"{subject} position {pos}", f"a value in [0, {m}) (a permutation of 0..{m - 1})",
                 int(indices[pos]))
    if m and np.bincount(indices, minlength=m).max() > 1:   # O(M); the sort below runs only on failure
        order = np.argsort(indices, kind="stable")
        repeated = indices[order[1:]] == indices[order[:-1]]
        later, earlier = order[1:][repeated], order[:-1][repeated]
        j = int(np.argmin(later))
        ctx.fail(rule, f"{subject} positions {int(earlier[j])} and {int(later[j])}",
                 f"distinct values (a permutation of 0..{m - 1})", f"{int(indices[later[j]])} twice")


FORWARD = register(OpSchema(
    op_type="MoeTokenUnpermute",
    inputs=(
        InputSpec("permuted_tokens", _FLOATS, doc="(rows, hidden): expert outputs in expert-sorted order"),
        InputSpec("sorted_indices", (I32,), doc="(tokens * topK,): slot t*K+k -> row; rows >= R are dropped"),
        InputSpec("probs", _FLOATS, optional=True, doc="(tokens, topK) routing weights; absent: topK = 1"),
    ),
    outputs=(OutputSpec("unpermuted_tokens", doc="(tokens, hidden)"),),
    attributes=(
        AttrSpec("padded_mode", AttrKind.BOOL, False, "ignored (MU-W1/MG-W1; MU-T5/MG-T3 on devices)"),
        AttrSpec("restore_shape", AttrKind.LIST_INT, (), "ignored"),
    ),
    type_combinations=tuple((t, I32, p) for t in _FLOATS for p in _FLOATS),
    infer=_forward_infer,
    check=_forward_check,
    validate=lambda ctx: validate_sorted_indices(ctx, "MU-D1"),
    validated_inputs=("sorted_indices",),
    doc="Gather each token's topK expert rows and sum them weighted by probs.",
))

GRAD = register(OpSchema(
    op_type="MoeTokenUnpermuteGrad",
    inputs=(
        InputSpec("permuted_tokens", _FLOATS, optional=True, doc="(len(sorted_indices), hidden); needed with probs"),
        InputSpec("unpermuted_tokens_grad", _FLOATS, doc="(tokens, hidden): gradient of the forward output"),
        InputSpec("sorted_indices", (I32,), doc="(tokens * topK,): slot t*K+k -> row"),
        InputSpec("probs", _FLOATS, optional=True, doc="(tokens, topK) routing weights"),
    ),
    outputs=(
        OutputSpec("permuted_tokens_grad", doc="(len(sorted_indices), hidden)"),
        OutputSpec("probs_grad", doc="shape of probs; without probs zeros (tokens, 1) of the token dtype"),
    ),
    attributes=(
        AttrSpec("padded_mode", AttrKind.BOOL, False, "ignored (MU-W1/MG-W1; MU-T5/MG-T3 on devices)"),
        AttrSpec("restore_shape", AttrKind.LIST_INT, (1, 1), "ignored"),
    ),
    type_combinations=tuple((t, t, I32, p) for t in _FLOATS for p in _FLOATS),
    infer=_grad_infer,
    check=_grad_check,
    validate=lambda ctx: validate_sorted_indices(ctx, "MG-D1"),
    validated_inputs=("sorted_indices",),
    doc="Gradients of MoeTokenUnpermute w.r.t. the permuted rows and the routing probabilities.",
))
