"""VJPs of the rotary ops (spec 2.4: the grad is the exact transpose of the forward in every mode).

Forward -> InplacePartialRotaryMulGrad with the same mode, slice, cos and sin (values outside the slice pass
through). cos and sin, when they need a cotangent, get one from standard ops: with g' = the slice as the
forward reads it (``forward(x; cos=1, sin=0)``, the half layout of mode 3) and r = its rotation
(``forward(x; cos=0, sin=1)``), d cos = sum(dy * g') and d sin = sum(dy * r) over the broadcast axes, in
float32. The grad op is linear in dy: its VJP is the forward op (cos and sin widened to float32 where the
forward does not take the grad's dtype pair); the grad op's cos and sin get no cotangent (not linear).
"""

from __future__ import annotations

import numpy as np

from ...ir._dtypes import DType
from ...ir._errors import GraphError
from ...ir._types import TensorType
from ..vjp import register_vjp
from .schema import FORWARD, GRAD, slice_bounds


def _bounds(node) -> tuple[int, int]:
    start, end = slice_bounds(node.attributes["partial_slice"], node.inputs[0].type.shape[3])
    if not isinstance(end, int):
        raise GraphError(f"geir.grad: {node.op_type} '{node.name}': the slice end is symbolic", node=node.name)
    return start, end


def _table_cotangent(ctx, node, dy, x, table, start: int, end: int, cos_value: float, sin_value: float):
    """sum over table's broadcast axes of dy[..., s:e] * forward(x; cos_value, sin_value)[..., s:e], float32."""
    shape = (1, 1, 1, end - start)
    ones, zeros = (ctx.const(np.full(shape, v, np.float32), "table") for v in (cos_value, sin_value))
    wide = ctx.cast(x, TensorType(DType.FLOAT32, x.type.shape))
    read = ctx.b.InplacePartialRotaryMul(wide, ones, zeros, rotary_mode=node.attributes["rotary_mode"],
                                         partial_slice=[start, end], name=ctx.fresh("rotary_read"))
    part = ctx.op("Slice", read, ctx.ints([start]), ctx.ints([end]), ctx.ints([3]))
    grad_part = ctx.op("Slice", ctx.cast(dy, wide.type), ctx.ints([start]), ctx.ints([end]), ctx.ints([3]))
    product = ctx.op("Mul", grad_part, part)
    return ctx.cast(ctx.sum_to(product, table), table.type)


@register_vjp(FORWARD.op_type)
def _forward(ctx, node, grads):
    dy = grads[0]
    x, cos, sin = (ctx.new(v) for v in node.inputs)
    start, end = _bounds(node)
    mode = node.attributes["rotary_mode"]
    if end == start:
        dx = ctx.op("Identity", dy)
    else:
        dx = ctx.b.InplacePartialRotaryMulGrad(dy, cos, sin, rotary_mode=mode, partial_slice=[start, end],
                                               name=ctx.fresh("rotary_grad"))
    tables = []
    for table, cos_value, sin_value in ((node.inputs[1], 1.0, 0.0), (node.inputs[2], 0.0, 1.0)):
        new = ctx.new(table)
        if not ctx.needs(table):
            tables.append(None)
        elif end == start:
            tables.append(ctx.zeros_like(new))
        else:
            tables.append(_table_cotangent(ctx, node, dy, x, new, start, end, cos_value, sin_value))
    return [dx, *tables]


@register_vjp(GRAD.op_type)
def _grad(ctx, node, grads):
    ddx = grads[0]
    _, cos, sin = (ctx.new(v) for v in node.inputs)
    start, end = _bounds(node)
    if end == start:
        return [ctx.op("Identity", ddx), None, None]
    legal = {(combo[0], combo[1]) for combo in FORWARD.type_combinations}
    if (ddx.type.dtype, cos.type.dtype) not in legal:     # the forward takes (x, float32 tables) for every x
        cos, sin = (ctx.op("Cast", t, to=DType.FLOAT32.onnx) for t in (cos, sin))
    back = ctx.b.InplacePartialRotaryMul(ddx, cos, sin, rotary_mode=node.attributes["rotary_mode"],
                                         partial_slice=[start, end], name=ctx.fresh("rotary_transpose"))
    return [back, None, None]
