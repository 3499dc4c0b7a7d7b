"""VJP of SparseFlashAttention (spec 4.7): the forward node is rewritten to return its softmax statistics
(``return_softmax_lse``; empty statistics it returned before become empty constants) and SparseFlashAttentionGrad
consumes them with the forward's out.

- KV merge: when value is key itself, or key's first D2 dims (a Slice of key from 0 on the last axis),
  the grad runs without value and adds d_value into d_key (CANN's merged form).
- sinks: the statistics already hold the sink's mass, so the grad is exact for query, key, value and the
  rope parts; the sinks' own cotangent, which CANN's grad does not produce, is written with standard ops:
  d sink_h = -sum over rows of exp(sink_h - lse) * rowsum(d_out * out), lse = max + log(sum) (rows the op
  never computed, sum 0, count 0).
- Not differentiated (a GraphError): paged KV (the grad has no PA_BSND form), BSND with length tensors
  (the grad ignores them, SG-W1, so it would see other rows than the forward did), and cotangents flowing
  into the statistics outputs. SparseFlashAttentionGrad itself has no rule: its adjoint is no op we have.
"""

from __future__ import annotations

import numpy as np

from ...ir._dtypes import DType
from ...ir._errors import GraphError
from ..vjp import register_vjp
from .schema import FORWARD, PAGED



def _rewrite(ctx, node, inputs):
    """The forward returning its statistics (return_softmax_lse), which its grad reads. A forward that returned
    the empty ones keeps them for whatever read them (a graph output, say) as empty constants of the same names:
    one forward node, where a second one returning the statistics would make the model hold two variants of the
    op, which ONNX export refuses. Paged KV is copied as it is (it has no grad)."""
    attrs = dict(node.attributes)
    if attrs["layout_kv"] == PAGED:
        return None
    empty = not attrs["return_softmax_lse"]
    attrs["return_softmax_lse"] = True
    names = [v.name if v is not None else "" for v in node.outputs]
    if empty:
        names[1:] = [ctx.fresh("sfa_max"), ctx.fresh("sfa_sum")]
    result = ctx.b.add_node(node.schema, inputs, attrs, name=node.name, output_names=names, location=node.location)
    ctx.state[id(node)] = (result[1], result[2])
    if not empty:
        return result
    outputs = {id(v) for v in ctx.forward.outputs}
    kept = [ctx.b.constant(v.name, np.zeros((0,), v.type.dtype.numpy)) if v is not None and (v.uses or id(v) in outputs)
            else stat for v, stat in zip(node.outputs[1:], result[1:])]
    return (result[0], *kept)


def _merged_value(ctx, node) -> bool:
    """Whether value is key, or key's leading dims on the last axis (KV merge)."""
    key, value = node.inputs[1], node.inputs[2]
    if value is key:
        return True
    producer = value.producer
    if producer is None or producer.op_type != "Slice" or producer.domain != "" or producer.inputs[0] is not key:
        return False
    parts = [ctx.constant_of(v) if v is not None else None for v in producer.inputs[1:]]
    starts, ends, axes = parts[0], parts[1], parts[2] if len(parts) > 2 else None
    steps = parts[3] if len(parts) > 3 else None
    rank = len(key.type.shape)
    if starts is None or ends is None or starts.size != 1 or (axes is not None and int(axes.reshape(-1)[0]) % rank
                                                              != rank - 1) or (axes is None and rank != 1):
        return False
    return int(starts.reshape(-1)[0]) == 0 and (steps is None or int(steps.reshape(-1)[0]) == 1)


def _sinks_cotangent(ctx, node, d_out, out, row_max, row_sum, sinks):
    layout = node.attributes["layout_query"]
    f32 = DType.FLOAT32.onnx
    inner = ctx.op("ReduceSum", ctx.op("Mul", ctx.op("Cast", d_out, to=f32), ctx.op("Cast", out, to=f32)),
                   ctx.ints([-1]), keepdims=0)                                   # (B, S1, N1) or (T1, N1)
    n1 = node.inputs[0].type.shape[-2]
    if layout == "BSND":        # (B, N2, S1, G) -> (B, S1, N2, G) -> (B, S1, N1)
        order, lead = [0, 2, 1, 3], 2
    else:                       # (N2, T1, G) -> (T1, N2, G) -> (T1, N1)
        order, lead = [1, 0, 2], 1

    def per_head(stat):
        moved = ctx.op("Transpose", stat, perm=order)
        rows = ctx.op("Slice", ctx.op("Shape", moved), ctx.ints([0]), ctx.ints([lead]))
        return ctx.op("Reshape", moved, ctx.op("Concat", rows, ctx.ints([n1]), axis=0))
    m, total = per_head(row_max), per_head(row_sum)
    computed = ctx.op("Greater", total, ctx.const(np.zeros((1,), "float32"), "zero"))
    safe = ctx.op("Where", computed, total, ctx.const(np.ones((1,), "float32"), "one"))
    lse = ctx.op("Add", m, ctx.op("Log", safe))
    mass = ctx.op("Exp", ctx.op("Sub", sinks, lse))                              # the sink's probability
    mass = ctx.op("Where", computed, mass, ctx.const(np.zeros((1,), "float32"), "zero"))
    weighted = ctx.op("Mul", mass, inner)
    return ctx.op("Neg", ctx.op("ReduceSum", weighted, ctx.ints(list(range(lead))), keepdims=0))


@register_vjp(FORWARD.op_type, rewrite=_rewrite)
def _forward(ctx, node, grads):
    d_out, d_max, d_sum = grads
    attrs = node.attributes
    where = f"geir.grad: {node.op_type} '{node.name}'"
    if d_max is not None or d_sum is not None:
        raise GraphError(f"{where}: its softmax statistics get a cotangent; they are not differentiated (pass "
                         f"outputs= without them)", node=node.name)
    if attrs["layout_kv"] == PAGED:
        raise GraphError(f"{where}: paged KV (layout_kv PA_BSND) has no gradient op (SparseFlashAttentionGrad has "
                         f"no paged form)", node=node.name)
    query, key, value, indices, _, aq, akv, query_rope, key_rope, sinks = (ctx.new(v) for v in node.inputs)
    layout = attrs["layout_query"]
    if layout == "BSND" and (aq is not None or akv is not None):
        raise GraphError(f"{where}: BSND with actual_seq_lengths: SparseFlashAttentionGrad ignores them (SG-W1) and "
                         f"would differentiate other rows than the forward computed; use TND", node=node.name)
    row_max, row_sum = ctx.state[id(node)]
    out = ctx.new(node.outputs[0])
    merged = _merged_value(ctx, node)
    lengths = (aq, akv) if layout == "TND" else (None, None)
    d_query, d_key, d_value, d_query_rope, d_key_rope = ctx.b.SparseFlashAttentionGrad(
        query, key, indices, d_out, out, row_max, row_sum, None if merged else value, *lengths, query_rope, key_rope,
        scale_value=attrs["scale_value"], sparse_block_size=attrs["sparse_block_size"], layout=layout,
        sparse_mode=attrs["sparse_mode"], name=ctx.fresh("sfa_grad"))
    d_sinks = _sinks_cotangent(ctx, node, d_out, out, row_max, row_sum, sinks) if ctx.needs(node.inputs[9]) else None
    return [d_query, d_key, ctx.accounted if merged else d_value, None, None, None, None, d_query_rope, d_key_rope,
            d_sinks]
