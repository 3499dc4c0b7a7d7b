"""ONNX bodies of MoeTokenPermute and MoeTokenPermuteGrad: standard ops only, memory-safe for any data.

Forward: ``TopK(ids, k=len(ids), largest=0, sorted=1)`` is a stable argsort by ONNX's own definition of TopK ("given
two equivalent values ... the element with the lower index will appear first"), so its indices are ``row2slot``
exactly, for any int64 ids; ``sorted_indices`` is its inverse by ``ScatterElements`` of ``0..M-1``; the kept rows
gather ``tokens[row2slot // K]`` (a bit copy, any dtype). Every index read is produced by TopK, so it is in range.
Grad: the rows gathered slot by slot from the gradient with a zero row appended (a dropped slot, ``r >= R``, and any
out-of-range id read it), reshaped to (T, K, H) and summed over K in float32, one rounding.
"""

from __future__ import annotations

from onnx import TensorProto, helper

from ...ir._lowering import LoweringSpec, register_lowering
from ...ir._onnx_body import Body
from .schema import FORWARD, GRAD


@register_lowering(FORWARD)
def permute_body(b: Body, spec: LoweringSpec) -> None:
    ids = b.op("Reshape", b.to_int64("indices"), b.ints(-1))                       # (M,) slot t*K + k
    slots = b.op("Shape", ids)                                                     # [M]
    _, row2slot = b.op("TopK", ids, slots, axis=0, largest=0, sorted=1, outputs=2)
    count = b.scalar(slots)
    positions = b.op("Range", b.const(0), count, b.const(1))
    zeros = b.op("ConstantOfShape", slots, value=helper.make_tensor("", TensorProto.INT64, [1], [0]))
    inverse = b.op("ScatterElements", zeros, row2slot, positions, axis=0)
    b.output("Cast", spec.out("sorted_indices"), inverse, to=TensorProto.INT32)
    n = b.attr_int("num_out_tokens")
    rows = b.where(b.op("LessOrEqual", n, b.const(0)), b.op("Add", n, count), n)
    rows = b.op("Max", b.op("Min", rows, count), b.const(0))                        # CANN's clamp to [0, M]
    kept = b.op("Slice", row2slot, b.ints(0), b.unsqueeze(rows, 0), b.ints(0))
    # max(K, 1): K of (T, K) indices, 1 for 1-D ones, and K = 0 (no slots, kept is empty) never divides by zero.
    # ReduceMax, not a ReduceProd of the trailing dims: ONNX Runtime's CUDA provider has no int64 ReduceProd.
    topk = b.op("ReduceMax", b.concat(b.op("Shape", "indices", start=1), b.ints(1)), keepdims=1)
    b.output("Gather", spec.out("permute_tokens"), "tokens", b.op("Div", kept, topk), axis=0)


@register_lowering(GRAD)
def permute_grad_body(b: Body, spec: LoweringSpec) -> None:
    grad = "permuted_output_grad"
    rows, hidden = b.dim(grad, 0), b.dim(grad, 1)
    zero_row = b.op("ConstantOfShape", b.concat(b.ints(1), hidden),
                    value=helper.make_tensor("", TensorProto.FLOAT, [1], [0]))
    table = b.concat(b.to_float(grad), zero_row, axis=0)                          # (R + 1, H)
    slots = b.to_int64("sorted_indices")
    kept = b.op("And", b.op("GreaterOrEqual", slots, b.const(0)), b.op("Less", slots, rows))
    index = b.where(kept, slots, rows)                                             # R: the zero row
    topk = b.unsqueeze(b.attr_int("num_topk"), 0)
    gathered = b.op("Gather", table, index, axis=0)                                # (M, H)
    tokens = b.op("Div", b.dim("sorted_indices", 0), topk)                          # T = M / K (MPG-S2)
    summed = b.sum(b.reshape(gathered, tokens, topk, hidden, allowzero=True), 1)    # H = 0 stays 0, no -1
    b.output("CastLike", spec.out("input_grad"), summed, grad)
