"""Vector-Jacobian products of the normalizations and Dropout.

LayerNormalization (every output: Y, and Mean and InvStdDev where something reads their cotangent), RMSNormalization
(opset 23), BatchNormalization in inference form (the running statistics as inputs, differentiated too) and in
training form (opset 14+: through the batch's statistics, and the running statistics it outputs), Dropout
(the identity in inference; in training the kept mask scaled by 1 / (1 - ratio), the forward node made to return its
mask). Statistics are recomputed in the derivative graph in the op's stash type (float32 for 16-bit inputs) unless
the forward node returns them.
"""

from __future__ import annotations

import numpy as np

from ..ir._errors import GraphError
from ..ir._registry import get_schema
from .standard_vjp import STANDARD, optional_input, scalar
from .standard_vjp_reduce import reduced_count
from .vjp import register_vjp

FLOAT = 1


def _compute_type(node, x):
    """The dtype statistics are computed in: stash_type (float32 by default) where the input is narrower."""
    if int(node.attributes.get("stash_type", FLOAT)) == FLOAT and x.type.dtype.itemsize < 4:
        return FLOAT
    return x.type.dtype.onnx


def _as(ctx, value, onnx_type: int):
    return value if value.type.dtype.onnx == onnx_type else ctx.op("Cast", value, to=onnx_type)


def _back(ctx, value, like):
    return ctx.cast(value, like.type) if value is not None else None


def _normalized_axes(node) -> list[int]:
    """The axes a LayerNormalization or RMSNormalization normalises over: ``axis`` and every one after it."""
    rank = len(node.inputs[0].type.shape)
    return list(range(int(node.attributes.get("axis", -1)) % rank, rank))


def _mean(ctx, value, axes):
    return ctx.op("ReduceMean", value, ctx.ints(axes), keepdims=1)


def _project(ctx, rstd, dxhat, xhat, axes, centred: bool):
    """rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)): the input's cotangent through x -> xhat (without the
    mean(dxhat) term for RMS normalization, which does not centre)."""
    inner = ctx.op("Mul", xhat, _mean(ctx, ctx.op("Mul", dxhat, xhat), axes))
    if centred:
        inner = ctx.op("Add", inner, _mean(ctx, dxhat, axes))
    return ctx.op("Mul", rstd, ctx.op("Sub", dxhat, inner))


@register_vjp("LayerNormalization", STANDARD)
def _layer_norm(ctx, node, grads):
    x, scale = ctx.new(node.inputs[0]), ctx.new(node.inputs[1])
    bias = ctx.new(optional_input(node, 2))
    axes = _normalized_axes(node)
    compute = _compute_type(node, x)
    xc = _as(ctx, x, compute)
    eps = scalar(ctx, xc, float(node.attributes.get("epsilon", 1e-5)))
    returned = [ctx.new(v) if v is not None else None for v in node.outputs[1:3]] + [None, None]
    if returned[0] is not None and returned[1] is not None:
        mean, rstd = _as(ctx, returned[0], compute), _as(ctx, returned[1], compute)
        centred = ctx.op("Sub", xc, mean)
    else:
        mean = _mean(ctx, xc, axes)
        centred = ctx.op("Sub", xc, mean)
        variance = _mean(ctx, ctx.op("Mul", centred, centred), axes)
        rstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", variance, eps)))
    xhat = ctx.op("Mul", centred, rstd)
    g = grads[0]
    dx = None
    if g is not None:
        gc = _as(ctx, g, compute)
        dxhat = ctx.op("Mul", gc, _as(ctx, scale, compute))
        dx = _project(ctx, rstd, dxhat, xhat, axes, centred=True)
    g_mean = grads[1] if len(grads) > 1 else None
    g_rstd = grads[2] if len(grads) > 2 else None
    if g_mean is not None:                 # mean = sum(x) / N
        part = ctx.op("Div", _as(ctx, g_mean, compute), reduced_count(ctx, xc, axes))
        part = ctx.op("Expand", part, ctx.shape_of(xc))
        dx = part if dx is None else ctx.op("Add", dx, part)
    if g_rstd is not None:                 # rstd = (var + eps)^-1/2, var = sum((x - mean)^2) / N
        cube = ctx.op("Mul", rstd, ctx.op("Mul", rstd, rstd))
        dvar = ctx.op("Mul", ctx.op("Neg", _as(ctx, g_rstd, compute)), cube)      # -1/2 rstd^3, times 2 below
        part = ctx.op("Div", ctx.op("Mul", dvar, centred), reduced_count(ctx, xc, axes))
        dx = part if dx is None else ctx.op("Add", dx, part)
    d_scale = d_bias = None
    if g is not None and ctx.needs(node.inputs[1]):
        d_scale = ctx.sum_to(_back(ctx, ctx.op("Mul", _as(ctx, g, compute), xhat), scale), scale)
    if g is not None and bias is not None and ctx.needs(node.inputs[2]):
        d_bias = ctx.sum_to(g if g.type.dtype == bias.type.dtype else _back(ctx, g, bias), bias)
    if dx is None:
        dx = ctx.zeros_like(x)
    return [_back(ctx, dx, x), d_scale, d_bias][:len(node.inputs)]


@register_vjp("RMSNormalization", STANDARD)
def _rms_norm(ctx, node, grads):
    x, scale = ctx.new(node.inputs[0]), ctx.new(node.inputs[1])
    axes = _normalized_axes(node)
    compute = _compute_type(node, x)
    xc = _as(ctx, x, compute)
    eps = scalar(ctx, xc, float(node.attributes.get("epsilon", 1e-5)))
    rstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", _mean(ctx, ctx.op("Mul", xc, xc), axes), eps)))
    xhat = ctx.op("Mul", xc, rstd)
    gc = _as(ctx, grads[0], compute)
    dx = _project(ctx, rstd, ctx.op("Mul", gc, _as(ctx, scale, compute)), xhat, axes, centred=False)
    d_scale = ctx.sum_to(_back(ctx, ctx.op("Mul", gc, xhat), scale), scale) if ctx.needs(node.inputs[1]) else None
    return [_back(ctx, dx, x), d_scale]


def _batch_axes(x) -> list[int]:
    """BatchNormalization's statistics axes: every axis but the channel (1)."""
    return [0] + list(range(2, len(x.type.shape)))


def _per_channel(ctx, x):
    """(channel, total) for BatchNormalization on ``x``: a (C,) value shaped to broadcast over x (in x's dtype), and
    a value of x's shape summed to (C,)."""
    per_channel = ctx.ints([-1] + [1] * (len(x.type.shape) - 2))
    axes = ctx.ints(_batch_axes(x))

    def channel(value):
        return ctx.op("Reshape", _as(ctx, value, x.type.dtype.onnx), per_channel)

    def total(value):
        return ctx.op("ReduceSum", value, axes, keepdims=0)
    return channel, total


@register_vjp("BatchNormalization", STANDARD)
def _batch_norm(ctx, node, grads):
    """Inference form: y = (x - mean) / sqrt(var + eps) * scale + bias per channel (axis 1); training form (opset
    14+, ``training_mode`` 1): the batch's own statistics, and the running ones as outputs."""
    version = node.version or 15
    if int(node.attributes.get("training_mode", 0)) and version >= 14:
        return _batch_norm_training(ctx, node, grads)
    if int(node.attributes.get("training_mode", 0)) or version < 9 or version < 14 and len(node.outputs) > 1:
        raise GraphError(f"geir.grad: BatchNormalization '{node.name}': only the inference form (opset >= 9) and "
                         f"the training form of opset 14+ (training_mode 1) are differentiated", node=node.name)
    x, scale, bias, mean, var = (ctx.new(v) for v in node.inputs)
    g = grads[0]
    channel, total = _per_channel(ctx, x)
    eps = scalar(ctx, x, float(node.attributes.get("epsilon", 1e-5)))
    rstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", _as(ctx, var, x.type.dtype.onnx), eps)))   # (C,)
    centred = ctx.op("Sub", x, channel(mean))
    dx = ctx.op("Mul", g, channel(ctx.op("Mul", _as(ctx, scale, x.type.dtype.onnx), rstd)))
    result: list = [dx, None, None, None, None]
    if ctx.needs(node.inputs[1]):
        result[1] = _back(ctx, total(ctx.op("Mul", g, ctx.op("Mul", centred, channel(rstd)))), scale)
    if ctx.needs(node.inputs[2]):
        result[2] = _back(ctx, total(g), bias)
    if ctx.needs(node.inputs[3]):
        result[3] = _back(ctx, ctx.op("Neg", total(dx)), mean)
    if ctx.needs(node.inputs[4]):
        cube = ctx.op("Mul", rstd, ctx.op("Mul", rstd, rstd))
        d_var = ctx.op("Mul", total(ctx.op("Mul", g, centred)),
                       ctx.op("Mul", _as(ctx, scale, x.type.dtype.onnx), ctx.op("Mul", cube, scalar(ctx, x, -0.5))))
        result[4] = _back(ctx, d_var, var)
    return result


def _batch_norm_training(ctx, node, grads):
    """y = (x - mu) / sqrt(v + eps) * scale + bias with mu, v the batch's mean and (population) variance per channel;
    running_mean = mean * momentum + mu * (1 - momentum), running_var likewise with v (ONNX's reference)."""
    x, scale, bias, mean, var = (ctx.new(v) for v in node.inputs)
    other = _batch_axes(x)
    momentum = float(node.attributes.get("momentum", 0.9))
    g_y, g_mean, g_var = (list(grads) + [None, None])[:3]
    channel, total = _per_channel(ctx, x)
    mu = _mean(ctx, x, other)
    centred = ctx.op("Sub", x, mu)
    rstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", _mean(ctx, ctx.op("Mul", centred, centred), other),
                                                      scalar(ctx, x, float(node.attributes.get("epsilon", 1e-5))))))
    xhat = ctx.op("Mul", centred, rstd)
    count = reduced_count(ctx, x, other)                                           # elements per channel
    dx = None
    result: list = [None] * 5
    if g_y is not None:
        dx = _project(ctx, rstd, ctx.op("Mul", g_y, channel(scale)), xhat, other, centred=True)
        if ctx.needs(node.inputs[1]):
            result[1] = _back(ctx, total(ctx.op("Mul", g_y, xhat)), scale)
        if ctx.needs(node.inputs[2]):
            result[2] = _back(ctx, total(g_y), bias)
    for g, stat, index, through in ((g_mean, mean, 3, None), (g_var, var, 4, centred)):
        if g is None:
            continue
        share = ctx.op("Div", channel(ctx.op("Mul", g, scalar(ctx, g, 1.0 - momentum))), count)    # d mu or d v / n
        part = share if through is None else ctx.op("Mul", ctx.op("Mul", share, scalar(ctx, x, 2.0)), through)
        part = ctx.op("Expand", part, ctx.shape_of(x))
        dx = part if dx is None else ctx.op("Add", dx, part)
        if ctx.needs(node.inputs[index]):
            result[index] = _back(ctx, ctx.op("Mul", g, scalar(ctx, g, momentum)), stat)
    result[0] = dx if dx is not None else ctx.zeros_like(x)
    return result


def _training(ctx, node) -> bool:
    """Whether a Dropout node drops (opset >= 12 with training_mode true); raises where that is not a constant."""
    if (node.version or 12) < 12 or optional_input(node, 2) is None:
        return False
    mode = ctx.constant_of(node.inputs[2])
    if mode is None:
        raise GraphError(f"geir.grad: Dropout '{node.name}': training_mode must be a constant of the graph to "
                         f"differentiate through it", node=node.name)
    return bool(np.asarray(mode).reshape(-1)[0])


def _dropout_rewrite(ctx, node, inputs):
    """A training Dropout that does not return its mask returns it in the derivative graph (its rule reads it)."""
    if len(node.outputs) > 1 and node.outputs[1] is not None:
        ctx.state[id(node)] = None
        return None
    if not _training(ctx, node):
        return None
    schema = get_schema("Dropout", "", node.name, outputs=2, version=node.version)
    result = ctx.b.add_node(schema, inputs, dict(node.attributes), name=node.name,
                            output_names=[node.outputs[0].name, ctx.fresh("dropout_mask")], location=node.location)
    ctx.state[id(node)] = result[1]
    return (result[0],) + (None,) * (len(node.outputs) - 1)


@register_vjp("Dropout", STANDARD, rewrite=_dropout_rewrite)
def _dropout(ctx, node, grads):
    g = grads[0]
    rest = [None] * (len(node.inputs) - 1)
    if not _training(ctx, node):
        return [g] + rest
    mask = ctx.state.get(id(node))
    if mask is None:
        mask = ctx.new(node.outputs[1])
    ratio = 0.5
    if optional_input(node, 1) is not None:
        given = ctx.constant_of(node.inputs[1])
        if given is None:
            raise GraphError(f"geir.grad: Dropout '{node.name}': ratio must be a constant of the graph to "
                             f"differentiate through it", node=node.name)
        ratio = float(np.asarray(given).reshape(-1)[0])
    if ratio >= 1.0:          # everything dropped: the output is zeros, whatever the input
        return [ctx.zeros_like(ctx.new(node.inputs[0]))] + rest
    kept = ctx.op("Cast", mask, to=g.type.dtype.onnx)
    return [ctx.op("Mul", g, ctx.op("Mul", kept, scalar(ctx, g, 1.0 / (1.0 - ratio))))] + rest

