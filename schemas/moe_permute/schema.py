"""MoeTokenPermute and MoeTokenPermuteGrad: the token side of the MoE loop whose other half is MoeTokenUnpermute.

Forward: every token is copied once per expert it is routed to, the copies ordered by expert id (a stable sort of
the flattened ids, ties by slot ``t*K + k``), the rows past ``num_out_tokens`` dropped. ``sorted_indices[t*K + k]`` is
the row holding slot (t, k): slot -> row, token-major -- exactly the ``sorted_indices`` MoeTokenUnpermute reads, so
a permute feeds its unpermute directly (rows ``>= R`` are the unpermute's dropped slots). Grad: each token sums the
gradient rows of its K copies (rows ``>= R`` were dropped and add nothing): MoeTokenUnpermute without weights.

Sources (ops-transformer; GE IR names are the op defs'):
- ``moe/moe_token_permute/op_host/moe_token_permute_def.cpp``: inputs ``tokens`` {bf16, f16, f32, int8} x ``indices``
  {int32, int64}; outputs ``permute_tokens`` (tokens' dtype), ``sorted_indices`` int32; ``num_out_tokens`` Int = 0,
  ``padded_mode`` Bool = false; AICore ascend910b, ascend910_93, ascend910_95 (int8 is the newest def's).
- ``moe_token_permute_infershape.cpp``: ``permute_tokens`` is tokens' shape with dim 0 = the rows below.
- ``moe_token_permute_tiling.cpp`` (A2/A3): padded_mode true fails; indices rank 1 or 2; indices dim 0 == tokens dim
  0; topK <= 512; T*K < 16777215; rows = ``n + T*K if n <= 0 else n``, clamped to [0, T*K].
- ``docs/aclnnMoeTokenPermute.md``: tokens rank >= 2 (trailing dims are the hidden size), empty tensors allowed,
  ids in [0, 16777215) (an older revision adds "int32/int64 min and max supported as single points"), int8 only on
  Ascend 950; ``op_api/aclnn_moe_token_permute.cpp``: on 950 (regbase) padded_mode true is ACLNN_ERR_PARAM_INVALID.
- ``moe/moe_token_permute_grad/op_host/moe_token_permute_grad_def.cpp``: ``permuted_output_grad`` {bf16, f16, f32},
  ``sorted_indices`` int32 -> ``input_grad``; ``num_topk`` Int REQUIRED, ``padded_mode`` Bool = false; AICore
  ascend910b, ascend910_93 only; its tiling takes tokens = len(sorted_indices) / num_topk and R = rows of the grad
  (its infershape's ``R / num_topk`` disagrees when rows were dropped: the tiling is what runs, and is followed here).
"""

from __future__ import annotations

import numpy as np

from ...ir._dtypes import DType
from ...ir._registry import register
from ...ir._schema import REQUIRED, AttrKind, AttrSpec, DataContext, InferContext, InputSpec, OpSchema, OutputSpec
from ...ir._types import Dim, TensorType
from ..index_bounds import largest_unsigned
from ..moe.schema import validate_sorted_indices

__all__ = ["FORWARD", "GRAD", "ID_LIMIT", "permuted_rows"]

F16, F32, BF16, I8, I32, I64 = DType.FLOAT16, DType.FLOAT32, DType.BFLOAT16, DType.INT8, DType.INT32, DType.INT64
_TOKENS = (BF16, F16, F32, I8)
_FLOATS = (BF16, F16, F32)
ID_LIMIT = 16777215
"""Expert ids CANN sorts correctly: [0, ID_LIMIT), and the index dtype's minimum and maximum (MP-D1)."""


def permuted_rows(num_out_tokens: int, slots: int) -> int:
    """Rows of ``permute_tokens``: 0 keeps all ``slots``; n > 0 the first n; n < 0 all but the last -n (CANN's
    tiling and infershape: ``n + slots`` when n <= 0, clamped to [0, slots])."""
    rows = num_out_tokens + slots if num_out_tokens <= 0 else num_out_tokens
    return max(0, min(rows, slots))


def _symbol(ctx: InferContext, what: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in f"{ctx.node}_{what}")


def _forward_check(ctx: InferContext) -> None:
    tokens, indices = ctx.input("tokens"), ctx.input("indices")
    ctx.require(tokens.rank >= 2, "MP-S1", ctx.input_subject("tokens"), "rank >= 2 (tokens, hidden...)",
                f"rank {tokens.rank} (shape {tokens})")
    ctx.require(indices.rank in (1, 2), "MP-S1", ctx.input_subject("indices"), "rank 1 (tokens,) or 2 (tokens, topK)",
                f"rank {indices.rank} (shape {indices})")
    ctx.require(ctx.equal(indices.shape[0], tokens.shape[0]), "MP-S2", ctx.input_subject("indices", 0),
                f"{tokens.shape[0]} (tokens, dim 0 of input 0 'tokens')", indices.shape[0])
    ctx.require(not ctx.attr("padded_mode"), "MP-S3", ctx.attr_subject("padded_mode"), "False", True,
                "padded_mode=True is not supported (CANN's tiling and aclnn refuse it)")


def _forward_infer(ctx: InferContext) -> None:
    tokens, indices = ctx.input("tokens"), ctx.input("indices")
    count, topk = indices.shape[0], indices.shape[1] if indices.rank == 2 else 1
    slots: Dim = count * topk if isinstance(count, int) and isinstance(topk, int) else \
        count if topk == 1 else _symbol(ctx, "slots")
    n = ctx.attr("num_out_tokens")
    rows: Dim = permuted_rows(n, slots) if isinstance(slots, int) else slots if n == 0 else _symbol(ctx, "rows")
    ctx.set_output(0, tokens.with_shape((rows, *tokens.shape[1:])))
    ctx.set_output(1, TensorType(I32, (slots,)))


def _validate_ids(ctx: DataContext) -> None:
    """MP-D1: every expert id in [0, 16777215) or the index dtype's minimum or maximum; name the first offender."""
    ids = ctx.array("indices")
    if largest_unsigned(ids) < ID_LIMIT:
        return      # every id in [0, ID_LIMIT): one array operation on the common path (index_bounds)
    info = np.iinfo(ids.dtype)
    bad = ((ids < 0) | (ids >= ID_LIMIT)) & (ids != info.min) & (ids != info.max)
    if bad.any():
        pos = np.unravel_index(int(np.argmax(bad.reshape(-1))), ids.shape)
        where = pos[0] if ids.ndim == 1 else tuple(int(p) for p in pos)
        ctx.fail("MP-D1", f"{ctx.input_subject('indices')} position {where}",
                 f"an expert id in [0, {ID_LIMIT}) or {info.min} or {info.max} (what CANN sorts correctly)",
                 int(ids[pos]))


def _grad_check(ctx: InferContext) -> None:
    grad, indices = ctx.input("permuted_output_grad"), ctx.input("sorted_indices")
    ctx.require(grad.rank == 2, "MPG-S1", ctx.input_subject("permuted_output_grad"), "rank 2 (rows, hidden)",
                f"rank {grad.rank} (shape {grad})")
    ctx.require(indices.rank == 1, "MPG-S1", ctx.input_subject("sorted_indices"), "rank 1 (tokens * topK,)",
                f"rank {indices.rank} (shape {indices})")
    topk, slots = ctx.attr("num_topk"), indices.shape[0]
    ctx.require(topk >= 1, "MPG-S2", ctx.attr_subject("num_topk"), "a value >= 1 (experts per token)", topk)
    ctx.require(slots % topk == 0 if isinstance(slots, int) else None, "MPG-S2", ctx.input_subject("sorted_indices", 0),
                f"a multiple of num_topk = {topk} (tokens * topK)", slots)
    ctx.require(not ctx.attr("padded_mode"), "MPG-S3", ctx.attr_subject("padded_mode"), "False", True,
                "padded_mode=True is not supported (CANN's docs and aclnn refuse it)")


def _grad_infer(ctx: InferContext) -> None:
    grad, slots, topk = ctx.input("permuted_output_grad"), ctx.input("sorted_indices").shape[0], ctx.attr("num_topk")
    tokens: Dim = slots // topk if isinstance(slots, int) else slots if topk == 1 else _symbol(ctx, "tokens")
    ctx.set_output(0, grad.with_shape((tokens, grad.shape[1])))


FORWARD = register(OpSchema(
    op_type="MoeTokenPermute",
    inputs=(
        InputSpec("tokens", _TOKENS, doc="(tokens, hidden...): the tokens to route"),
        InputSpec("indices", (I32, I64), doc="(tokens, topK) or (tokens,): the expert ids of each token"),
    ),
    outputs=(
        OutputSpec("permute_tokens", doc="(rows, hidden...): one copy per slot, sorted by expert (stable)"),
        OutputSpec("sorted_indices", doc="(tokens * topK,) int32: slot t*K+k -> row; rows >= R were dropped"),
    ),
    attributes=(
        AttrSpec("num_out_tokens", AttrKind.INT, 0, "rows kept: 0 all, n > 0 the first n, n < 0 all but the last -n"),
        AttrSpec("padded_mode", AttrKind.BOOL, False, "must be False (True is not supported)"),
    ),
    type_combinations=tuple((t, i) for t in _TOKENS for i in (I32, I64)),
    infer=_forward_infer,
    check=_forward_check,
    validate=_validate_ids,
    validated_inputs=("indices",),
    doc="Copy each token once per routed expert, the copies sorted by expert id (stable).",
    exact_across_runtimes=True,     # an integer sort and bit copies
))

GRAD = register(OpSchema(
    op_type="MoeTokenPermuteGrad",
    inputs=(
        InputSpec("permuted_output_grad", _FLOATS, doc="(rows, hidden): gradient of permute_tokens"),
        InputSpec("sorted_indices", (I32,), doc="(tokens * topK,): slot t*K+k -> row; rows >= R are dropped"),
    ),
    outputs=(OutputSpec("input_grad", doc="(tokens, hidden)"),),
    attributes=(
        AttrSpec("num_topk", AttrKind.INT, REQUIRED, "topK: experts per token"),
        AttrSpec("padded_mode", AttrKind.BOOL, False, "must be False (True is not supported)"),
    ),
    type_combinations=tuple((t, I32) for t in _FLOATS),
    infer=_grad_infer,
    check=_grad_check,
    validate=lambda ctx: validate_sorted_indices(ctx, "MPG-D1"),
    validated_inputs=("sorted_indices",),
    doc="Gradient of MoeTokenPermute w.r.t. tokens: each token sums its topK gradient rows (float32, k order).",
))
