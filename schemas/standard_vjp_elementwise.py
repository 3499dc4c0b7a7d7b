"""Vector-Jacobian products of the standard elementwise functions: the cotangent times the derivative, written with
the op's output where that is cheaper.

Exp, Log, Sqrt, Reciprocal, Tanh, Sigmoid, Relu, LeakyRelu, Abs, Erf, Gelu (exact and tanh), Softplus, Sin, Cos,
Pow (base and exponent), Clip (input and bounds), Max, Min, Sum, Mean (variadic, broadcasting), Where, and the
piecewise-constant Sign, Floor, Ceil, Round, whose cotangent is zero. Where a function is not differentiable, the
choice is torch's: Relu, LeakyRelu and Clip pass the cotangent where x > 0 (x inside [min, max]), tied Max/Min
operands share it equally, Abs's is 0 at 0. Selections are Wheres, so a non-finite cotangent never leaks into the
positions it does not reach.
"""

from __future__ import annotations

import math

import numpy as np

from .standard_vjp import STANDARD, optional_input, scalar
from .vjp import register_vjp


@register_vjp("Exp", STANDARD)
def _exp(ctx, node, grads):
    return [ctx.op("Mul", grads[0], ctx.new(node.outputs[0]))]                          # d exp(x) = exp(x)


@register_vjp("Log", STANDARD)
def _log(ctx, node, grads):
    return [ctx.op("Div", grads[0], ctx.new(node.inputs[0]))]                           # d log(x) = 1 / x


@register_vjp("Sqrt", STANDARD)
def _sqrt(ctx, node, grads):
    y = ctx.new(node.outputs[0])
    return [ctx.op("Div", grads[0], ctx.op("Mul", y, scalar(ctx, y, 2.0)))]              # d sqrt(x) = 1 / (2 y)


@register_vjp("Reciprocal", STANDARD)
def _reciprocal(ctx, node, grads):
    y = ctx.new(node.outputs[0])
    return [ctx.op("Neg", ctx.op("Mul", grads[0], ctx.op("Mul", y, y)))]                # d (1/x) = -y^2


@register_vjp("Tanh", STANDARD)
def _tanh(ctx, node, grads):
    y = ctx.new(node.outputs[0])
    return [ctx.op("Mul", grads[0], ctx.op("Sub", scalar(ctx, y, 1.0), ctx.op("Mul", y, y)))]   # 1 - y^2


def _sigmoid_of(ctx, y, g):
    return ctx.op("Mul", g, ctx.op("Mul", y, ctx.op("Sub", scalar(ctx, y, 1.0), y)))              # y (1 - y)


@register_vjp("Sigmoid", STANDARD)
def _sigmoid(ctx, node, grads):
    return [_sigmoid_of(ctx, ctx.new(node.outputs[0]), grads[0])]


@register_vjp("Relu", STANDARD)
def _relu(ctx, node, grads):
    """The cotangent where x > 0, and 0 elsewhere."""
    x = ctx.new(node.inputs[0])
    return [ctx.op("Where", ctx.op("Greater", x, scalar(ctx, x, 0.0)), grads[0], scalar(ctx, x, 0.0))]


@register_vjp("LeakyRelu", STANDARD)
def _leaky_relu(ctx, node, grads):
    """The cotangent where x > 0, alpha times it elsewhere."""
    x, g = ctx.new(node.inputs[0]), grads[0]
    alpha = float(node.attributes.get("alpha", 0.01))
    return [ctx.op("Where", ctx.op("Greater", x, scalar(ctx, x, 0.0)), g, ctx.op("Mul", g, scalar(ctx, x, alpha)))]


@register_vjp("Abs", STANDARD)
def _abs(ctx, node, grads):
    return [ctx.op("Mul", grads[0], ctx.op("Sign", ctx.new(node.inputs[0])))]             # sign(x); 0 at 0


def _erf_derivative(ctx, x, scale: float):
    """d/dx erf(scale x) = scale 2/sqrt(pi) exp(-(scale x)^2)."""
    scaled = ctx.op("Mul", x, scalar(ctx, x, scale))
    bell = ctx.op("Exp", ctx.op("Neg", ctx.op("Mul", scaled, scaled)))
    return ctx.op("Mul", bell, scalar(ctx, x, scale * 2.0 / math.sqrt(math.pi)))


@register_vjp("Erf", STANDARD)
def _erf(ctx, node, grads):
    return [ctx.op("Mul", grads[0], _erf_derivative(ctx, ctx.new(node.inputs[0]), 1.0))]


GELU_TANH_COEFFICIENT = 0.044715


@register_vjp("Gelu", STANDARD)
def _gelu(ctx, node, grads):
    """Exact: Phi(x) + x phi(x). Tanh: with u = k (x + c x^3),
    d = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k (1 + 3 c x^2), k = sqrt(2 / pi), c = 0.044715 (ONNX's and torch's
    approximation)."""
    x, g = ctx.new(node.inputs[0]), grads[0]
    half, one = scalar(ctx, x, 0.5), scalar(ctx, x, 1.0)
    if node.attributes.get("approximate", "none") == "tanh":
        k, c = math.sqrt(2.0 / math.pi), GELU_TANH_COEFFICIENT
        x2 = ctx.op("Mul", x, x)
        cubic = ctx.op("Mul", scalar(ctx, x, c), ctx.op("Mul", x2, x))
        inner = ctx.op("Mul", scalar(ctx, x, k), ctx.op("Add", x, cubic))
        t = ctx.op("Tanh", inner)
        left = ctx.op("Mul", half, ctx.op("Add", one, t))
        slope = ctx.op("Mul", scalar(ctx, x, k), ctx.op("Add", one, ctx.op("Mul", scalar(ctx, x, 3 * c), x2)))
        right = ctx.op("Mul", ctx.op("Mul", half, x), ctx.op("Mul", ctx.op("Sub", one, ctx.op("Mul", t, t)), slope))
        return [ctx.op("Mul", g, ctx.op("Add", left, right))]
    cdf = ctx.op("Mul", half, ctx.op("Add", one, ctx.op("Erf", ctx.op("Mul", x, scalar(ctx, x, 1 / math.sqrt(2.0))))))
    x2 = ctx.op("Mul", x, x)
    bell = ctx.op("Exp", ctx.op("Mul", x2, scalar(ctx, x, -0.5)))
    pdf = ctx.op("Mul", bell, scalar(ctx, x, 1 / math.sqrt(2 * math.pi)))
    return [ctx.op("Mul", g, ctx.op("Add", cdf, ctx.op("Mul", x, pdf)))]


@register_vjp("Softplus", STANDARD)
def _softplus(ctx, node, grads):
    return [ctx.op("Mul", grads[0], ctx.op("Sigmoid", ctx.new(node.inputs[0])))]          # d log(1 + e^x) = sigmoid


@register_vjp("Sin", STANDARD)
def _sin(ctx, node, grads):
    return [ctx.op("Mul", grads[0], ctx.op("Cos", ctx.new(node.inputs[0])))]


@register_vjp("Cos", STANDARD)
def _cos(ctx, node, grads):
    return [ctx.op("Neg", ctx.op("Mul", grads[0], ctx.op("Sin", ctx.new(node.inputs[0]))))]


def _flat(ctx, node, grads):
    """A piecewise-constant function: its cotangent is zero (torch's choice at the jumps too)."""
    return [ctx.zeros_like(ctx.new(node.inputs[0]))]


for _op in ("Sign", "Floor", "Ceil", "Round"):
    register_vjp(_op, STANDARD)(_flat)


@register_vjp("Pow", STANDARD)
def _pow(ctx, node, grads):
    """d x^y / dx = y x^(y-1); d x^y / dy = x^y log x, 0 where x = 0 and y >= 0 (torch's choice: 0^y is flat
    there). An integer exponent is a constant of the function: it gets no cotangent."""
    g = grads[0]
    x, y, z = ctx.new(node.inputs[0]), ctx.new(node.inputs[1]), ctx.new(node.outputs[0])
    exponent = ctx.cast(y, x.type)
    if ctx.constant_of(node.inputs[1]) is not None and np.all(ctx.constant_of(node.inputs[1]) == 2):
        slope = ctx.op("Mul", x, scalar(ctx, x, 2.0))                                    # the common square
    else:
        slope = ctx.op("Mul", exponent, ctx.op("Pow", x, ctx.op("Sub", exponent, scalar(ctx, x, 1.0))))
    dx = ctx.sum_to(ctx.op("Mul", g, slope), x)
    if not ctx.needs(node.inputs[1]):
        return [dx, None]
    zero = scalar(ctx, x, 0.0)
    flat = ctx.op("And", ctx.op("Equal", x, zero), ctx.op("GreaterOrEqual", exponent, zero))
    log = ctx.op("Log", ctx.op("Where", ctx.op("Equal", x, zero), scalar(ctx, x, 1.0), x))   # no log(0) evaluated
    dy = ctx.op("Where", flat, zero, ctx.op("Mul", g, ctx.op("Mul", z, log)))
    return [dx, ctx.sum_to(dy, y)]


@register_vjp("Clip", STANDARD)
def _clip(ctx, node, grads):
    """The cotangent where min <= x <= max; a bound given as an input gets it where it was taken (max everywhere
    when min > max, where ONNX clips every value to max)."""
    g = grads[0]
    x = ctx.new(node.inputs[0])
    zero = scalar(ctx, x, 0.0)
    low, high = ctx.new(optional_input(node, 1)), ctx.new(optional_input(node, 2))
    if low is None and "min" in node.attributes:                  # Clip before opset 11: bounds are attributes
        low = scalar(ctx, x, float(node.attributes["min"]))
    if high is None and "max" in node.attributes:
        high = scalar(ctx, x, float(node.attributes["max"]))
    inside = None
    if low is not None:
        inside = ctx.op("GreaterOrEqual", x, low)
    if high is not None:
        below = ctx.op("LessOrEqual", x, high)
        inside = below if inside is None else ctx.op("And", inside, below)
    dx = g if inside is None else ctx.op("Where", inside, g, zero)
    result = [dx] + [None] * (len(node.inputs) - 1)
    if ctx.needs(optional_input(node, 1)):
        taken = ctx.op("Less", x, low)
        if high is not None:
            taken = ctx.op("And", taken, ctx.op("LessOrEqual", low, high))
        result[1] = ctx.sum_to(ctx.op("Where", taken, g, zero), low)
    if ctx.needs(optional_input(node, 2)):
        taken = ctx.op("Greater", x, high)
        if low is not None:
            taken = ctx.op("Or", taken, ctx.op("Greater", low, high))
        result[2] = ctx.sum_to(ctx.op("Where", taken, g, zero), high)
    return result


def _extremum(ctx, node, grads):
    """Max or Min of any number of broadcasting operands: each operand equal to the result shares the cotangent
    with the others that tie there."""
    g, y = grads[0], ctx.new(node.outputs[0])
    zero = scalar(ctx, y, 0.0)
    operands = [ctx.new(v) for v in node.inputs]
    hits = [ctx.op("Equal", v, y) for v in operands]
    ties = None
    for hit in hits:
        counted = ctx.op("Cast", hit, to=y.type.dtype.onnx)
        ties = counted if ties is None else ctx.op("Add", ties, counted)
    share = ctx.op("Div", g, ctx.op("Max", ties, scalar(ctx, y, 1.0)))        # a NaN result ties nothing
    return [ctx.sum_to(ctx.op("Where", hit, share, zero), v) if ctx.needs(value) else None
            for hit, v, value in zip(hits, operands, node.inputs)]


for _op in ("Max", "Min"):
    register_vjp(_op, STANDARD)(_extremum)


@register_vjp("Sum", STANDARD)
def _sum(ctx, node, grads):
    return [ctx.sum_to(grads[0], ctx.new(v)) if ctx.needs(v) else None for v in node.inputs]


@register_vjp("Mean", STANDARD)
def _mean(ctx, node, grads):
    g = ctx.op("Div", grads[0], scalar(ctx, grads[0], float(len(node.inputs))))
    return [ctx.sum_to(g, ctx.new(v)) if ctx.needs(v) else None for v in node.inputs]


@register_vjp("Where", STANDARD)
def _where(ctx, node, grads):
    g = grads[0]
    condition, a, b = (ctx.new(v) for v in node.inputs)
    zero = scalar(ctx, g, 0.0)
    da = ctx.sum_to(ctx.op("Where", condition, g, zero), a) if ctx.needs(node.inputs[1]) else None
    db = ctx.sum_to(ctx.op("Where", condition, zero, g), b) if ctx.needs(node.inputs[2]) else None
    return [None, da, db]
