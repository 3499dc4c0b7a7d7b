"""InplacePartialRotaryMul and InplacePartialRotaryMulGrad (spec section 2).

Rotary position embedding, or its gradient, applied in place to the slice ``[start, end)``
of the last axis of a 4-D tensor ``X`` of shape (B, S, N, D); ``cos``/``sin`` have shape
(B|1, S|1, N|1, L) with ``L = end - start`` and broadcast onto ``X[..., start:end]``. The grad is the
identity when the slice or any of dy/cos/sin is empty (``grad_is_noop``, issue 27, item 3); the forward
is the identity for an empty slice.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...ir._dtypes import DType
from ...ir._types import BroadcastError, Dim, TensorType

from ...ir._registry import register
from ...ir._schema import AttrKind, AttrSpec, InferContext, InputSpec, OpSchema, OutputSpec

__all__ = ["FORWARD", "GRAD", "ROTARY_MODES", "grad_is_noop", "rotary_slice"]

F16, F32, BF16 = DType.FLOAT16, DType.FLOAT32, DType.BFLOAT16
_FLOATS = (F16, F32, BF16)
ROTARY_MODES = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}
EMPTY_GRAD_SLICE_HINT = ("an empty slice (the default [0, 0]) makes the grad the identity: almost always a forgotten "
                         "partial_slice; CANN's code returns dy unchanged, its docs call an empty slice unsupported")


def slice_bounds(partial_slice: Sequence[int], d: Dim) -> tuple[int, Dim]:
    """``(start, end)`` of the rotated slice of a last axis of size ``d``: ``[]`` means ``[0, D]``.

    The one statement of the attribute's meaning: the rules, the NumPy kernels and the ONNX body
    (which writes the same with Concat/Slice, tested against this) all follow it.
    """
    if len(partial_slice) == 0:
        return 0, d
    start, end = partial_slice
    return int(start), int(end)


def grad_is_noop(length: Dim, *shapes: Sequence[Dim]) -> bool:
    """Whether the grad is the identity without reading cos/sin: an empty slice, or an empty ``dy``, ``cos`` or
    ``sin`` (some dimension 0; a symbolic dimension counts as non-zero until it is fed).

    ops-transformer posembedding/inplace_partial_rotary_mul_grad/op_host/
    inplace_partial_rotary_mul_grad_tiling_base_arch35.cpp @2b888cdb (2026-08): ``sliceLength_ == 0 || dySize == 0
    || cosSize == 0 || sinSize == 0`` selects the empty-tensor tiling key, whose kernel returns dy unchanged; the
    tiling still checks rank 4, cos == sin shapes, dtypes, the mode, the slice bounds and cos D <= dy D first
    (RP-S1..S5, RP-S7b, RP-T2) and skips the rest (RP-S6..S9, RP-T3). That device, the only one with a grad
    kernel, defines the reference semantics here: identity (issue 27, item 3).
    """
    return length == 0 or any(d == 0 for shape in shapes for d in shape)


def rotary_slice(ctx: InferContext) -> tuple[int, Dim, Dim]:
    """``(start, end, length)`` of the rotated slice of the node in ``ctx``."""
    start, end = slice_bounds(ctx.attr("partial_slice"), ctx.input(0).shape[3])
    length: Dim = end - start if isinstance(end, int) else end
    return start, end, length


def _check(ctx: InferContext) -> None:
    is_grad = ctx.schema is GRAD
    x, cos, sin = ctx.inputs
    for i, t in enumerate((x, cos, sin)):
        ctx.require(t.rank == 4, "RP-S1", ctx.input_subject(i), "rank 4", f"rank {t.rank} (shape {t})")
    for k, (c, s) in enumerate(zip(cos.shape, sin.shape)):
        ctx.require(ctx.equal(c, s), "RP-S2", ctx.input_subject(2, k), f"{c} (shape of input 1 'cos' is "
                    f"{list(cos.shape)})", f"{s} (shape of input 2 'sin' is {list(sin.shape)})")
    pslice = ctx.attr("partial_slice")
    legal_lengths = (2,) if is_grad else (0, 2)
    ctx.require(len(pslice) in legal_lengths, "RP-S3", ctx.attr_subject("partial_slice"),
                " or ".join(map(str, legal_lengths)) + " elements ([start, end))", f"{len(pslice)} elements {list(pslice)}")
    mode = ctx.attr("rotary_mode")
    ctx.require(mode in ROTARY_MODES, "RP-S4", ctx.attr_subject("rotary_mode"), "one of 0 (half), 1 (interleave), "
                "2 (quarter), 3 (interleave-half)", mode)
    start, end, length = rotary_slice(ctx)
    d = x.shape[3]
    bounds = f"0 <= start <= end <= D = {d}"
    got = f"start={start}, end={end}"
    ctx.require(0 <= start <= end if isinstance(end, int) else start >= 0, "RP-S5",
                ctx.attr_subject("partial_slice"), bounds, got)
    if isinstance(end, int) and isinstance(d, int):
        ctx.require(end <= d, "RP-S5", ctx.attr_subject("partial_slice"), bounds, got)
    elif isinstance(end, int):
        ctx.deferred.append("RP-S5")
    if not isinstance(length, int):  # symbolic D with forward slice []: rules depending on L wait for run time
        ctx.deferred += ["RP-S6", "RP-S7", "RP-S8", "RP-S9"]
        return
    if is_grad and grad_is_noop(length, x.shape, cos.shape, sin.shape):
        # The grad is the identity (an empty slice or an empty dy/cos/sin): RP-S6..S9 do not apply (issue 27,
        # item 3: the arch35 tiling's empty-tensor key); RP-S7b (cos D <= D) still does, as in that tiling.
        if length == 0:
            ctx.warn("RP-W1", ctx.attr_subject("partial_slice"), "a non-empty slice [start, end)", list(pslice),
                     EMPTY_GRAD_SLICE_HINT)
        c3 = cos.shape[3]
        ok = c3 <= d if isinstance(c3, int) and isinstance(d, int) else None
        ctx.require(ok, "RP-S7b", ctx.input_subject(1, 3), f"<= D = {d} (the grad is the identity here)", c3)
        return
    if length > 0:      # forward with L > 0; every grad that is not the identity
        for i, t in enumerate((x, cos, sin)):
            for k, dim in enumerate(t.shape):
                ctx.require(dim != 0, "RP-S6", ctx.input_subject(i, k), "a non-zero extent", 0,
                            "zero-size tensors are rejected when the slice is not empty")
        _check_broadcast(ctx, x, cos)
        ctx.require(ctx.equal(cos.shape[3], length), "RP-S7", ctx.input_subject(1, 3),
                    f"{length} (slice length end - start = {end} - {start})", cos.shape[3],
                    "cos/sin are not sliced: their last axis already has the slice length")
        multiple = 4 if mode == 2 else 2
        ctx.require(length % multiple == 0, "RP-S9", ctx.attr_subject("partial_slice"),
                    f"a slice length divisible by {multiple} for rotary_mode {mode}", f"{length} ({got})")


def _check_broadcast(ctx: InferContext, x: TensorType, cos: TensorType) -> None:
    """RP-S8: cos/sin dims 0..2 broadcast onto X's without enlarging it (each is 1 or X's)."""
    try:
        result = ctx.symbols.broadcast(cos.shape[:3], x.shape[:3])
        verdicts = [ctx.equal(r, xd) for r, xd in zip(result, x.shape[:3])]
    except BroadcastError as exc:
        verdicts = [True, True, True]
        verdicts[exc.axis] = False
    for k, ok in enumerate(verdicts):
        ctx.require(ok, "RP-S8", ctx.input_subject(1, k), f"1 or {x.shape[k]} (dim {k} of input 0 "
                    f"'{ctx.schema.inputs[0].name}')", cos.shape[k], "cos/sin broadcast onto (B, S, N, end - start)")


def _infer(ctx: InferContext) -> None:
    ctx.set_output(0, ctx.input(0))


def _declare(op_type: str, tensor: str, combos: tuple[tuple[DType, DType, DType], ...], doc: str) -> OpSchema:
    return register(OpSchema(
        op_type=op_type,
        inputs=(
            InputSpec(tensor, _FLOATS, doc="(B, S, N, D); rotated in place on [start, end)"),
            InputSpec("cos", _FLOATS, doc="(B|1, S|1, N|1, end - start)"),
            InputSpec("sin", _FLOATS, doc="same shape as cos"),
        ),
        outputs=(OutputSpec(tensor, alias=0, doc="aliases input 0"),),
        attributes=(
            AttrSpec("rotary_mode", AttrKind.INT, 0, "0 half, 1 interleave, 2 quarter, 3 interleave-half"),
            AttrSpec("partial_slice", AttrKind.LIST_INT, (0, 0), "[start, end) on the last axis"),
        ),
        type_combinations=combos,
        infer=_infer,
        check=_check,
        doc=doc,
        exact_across_runtimes=True,   # elementwise, every rounding fixed by the contract (spec 2.4)
    ))


FORWARD = _declare(
    "InplacePartialRotaryMul", "x",
    ((F16, F16, F16), (F32, F32, F32), (BF16, BF16, BF16), (F16, F32, F32), (BF16, F32, F32)),
    "Rotary position embedding applied in place to x[..., start:end].",
)
GRAD = _declare(
    "InplacePartialRotaryMulGrad", "dy",
    tuple((d, c, c) for d in _FLOATS for c in _FLOATS),
    "Gradient of InplacePartialRotaryMul, applied in place to dy[..., start:end].",
)
