"""ONNX bodies of the MoE unpermute ops (spec 3.3): Gather / ScatterND in float32.

Bodies are specialised on which optional inputs exist (ONNX Runtime cannot branch on an
absent input inside a function). Indices are clamped before every Gather/ScatterND so the
body stays memory-safe for any data; invalid data gives unspecified values there, as the
contract allows (the geir runtimes validate graph inputs before running).
"""

from __future__ import annotations

from onnx import TensorProto, helper

from ...ir._onnx_body import Body
from ...ir._lowering import LoweringSpec, register_lowering
from .schema import FORWARD, GRAD


def _clamp(b: Body, idx: str, size: str) -> str:
    return b.op("Max", b.op("Min", idx, b.op("Sub", size, b.ints(1))), b.ints(0))


def _with_zero_row(b: Body, name: str) -> str:
    """``name`` (R, H) in float32 with a row of zeros appended: a Gather from it is in range even when R = 0 (every
    slot dropped), where ONNX Runtime refuses any Gather from an empty axis."""
    zeros = b.op("ConstantOfShape", b.concat(b.ints(1), b.dim(name, 1)),
                 value=helper.make_tensor("", TensorProto.FLOAT, [1], [0]))
    return b.concat(b.to_float(name), zeros, axis=0)


@register_lowering(FORWARD)
def moe_forward(b: Body, spec: LoweringSpec) -> None:
    rows = b.dim("permuted_tokens", 0)
    slots = b.to_int64("sorted_indices")
    tokens32 = _with_zero_row(b, "permuted_tokens")                             # (R + 1, H)
    rows_read = b.op("Add", rows, b.ints(1))
    zero = b.f32(0.0)
    if spec.has("probs"):
        topk = b.dim("probs", 1)
        index = b.reshape(slots, b.dim("probs", 0), topk, allowzero=True)       # (Tn, K); K or Tn may be 0
        weights = b.to_float("probs")
        keep = b.op("And", b.op("Less", index, rows), b.op("Not", b.op("Equal", weights, zero)))
        gathered = b.op("Gather", tokens32, _clamp(b, index, rows_read), axis=0)  # (Tn, K, H)
        weighted = b.op("Mul", gathered, b.unsqueeze(weights, 2))
        total = b.sum(b.where(b.unsqueeze(keep, 2), weighted, zero), 1)
    else:
        keep = b.op("Less", slots, rows)
        gathered = b.op("Gather", tokens32, _clamp(b, slots, rows_read), axis=0)  # (M, H)
        total = b.where(b.unsqueeze(keep, 1), gathered, zero)
    b.output("CastLike", "unpermuted_tokens", total, "permuted_tokens")


@register_lowering(GRAD)
def moe_grad(b: Body, spec: LoweringSpec) -> None:
    grad = "unpermuted_tokens_grad"
    slots = b.dim("sorted_indices", 0)
    hidden = b.dim(grad, 1)
    target = b.unsqueeze(_clamp(b, b.to_int64("sorted_indices"), slots), 1)     # (M, 1)
    zeros = b.op("ConstantOfShape", b.concat(slots, hidden), value=helper.make_tensor("", TensorProto.FLOAT, [1], [0]))
    grad32 = b.to_float(grad)
    if spec.has("probs"):
        weights = b.to_float("probs")
        weighted = b.op("Mul", b.unsqueeze(grad32, 1), b.unsqueeze(weights, 2))  # (Tn, K, H)
        rows = b.reshape(b.round_trip(weighted, grad), slots, hidden)
        scattered = b.op("ScatterND", zeros, target, rows)
        index = b.reshape(_clamp(b, b.to_int64("sorted_indices"), slots), b.dim("probs", 0), b.dim("probs", 1))
        unweighted = b.op("Gather", b.to_float("permuted_tokens"), index, axis=0)  # (Tn, K, H)
        dots = b.sum(b.op("Mul", unweighted, b.unsqueeze(grad32, 1)), 2)
        b.output("CastLike", spec.out("probs_grad"), dots, "probs")
    else:
        scattered = b.op("ScatterND", zeros, target, grad32)                  # exact: f16/bf16 -> f32 -> back
        tokens = b.dim(grad, 0)
        zero_grad = b.op("ConstantOfShape", b.concat(tokens, b.ints(1)),
                         value=helper.make_tensor("", TensorProto.FLOAT, [1], [0]))
        b.output("CastLike", spec.out("probs_grad"), zero_grad, grad)
    b.output("CastLike", spec.out("permuted_tokens_grad"), scattered, grad)
