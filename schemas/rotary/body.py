"""ONNX bodies of the rotary ops (spec 2.4): one body for all four modes.

The partner index, the pair sign and the mode-3 (de)interleave permutations are computed
from ``rotary_mode`` and the slice with integer ops and selected with ``Where``; with the
attributes constant, ONNX Runtime folds all of it into constant Gather indices. Compute is
float32 (``y = c*g + m*gather(g, partner)``, the kernels' products), rounded once; the
parts outside the slice are concatenated back untouched. An empty slice or an empty x/cos/sin makes the op
the identity (``schema.grad_is_noop``): the body then rotates an empty slice and reads cos/sin as (1, 1, 1, 0).
"""

from __future__ import annotations

from ...ir._onnx_body import Body
from ...ir._lowering import LoweringSpec, register_lowering
from .schema import FORWARD, GRAD


def _rotary_body(b: Body, x: str, out: str, is_grad: bool) -> None:
    d = b.dim(x, 3)
    bounds = b.concat(b.attr_ints("partial_slice"), b.ints(0), d)      # [] means [0, D]
    start, end = b.slice(bounds, b.ints(0), b.ints(1), 0), b.slice(bounds, b.ints(1), b.ints(2), 0)
    empty = [b.op("Equal", b.op("ReduceMin", b.op("Shape", t), keepdims=0), b.const(0)) for t in (x, "cos", "sin")]
    noop = b.op("Or", b.op("Equal", end, start), b.op("Or", empty[0], b.op("Or", empty[1], empty[2])))
    end = b.where(noop, start, end)       # the identity (grad_is_noop): rotate the empty slice [start, start)
    length = b.op("Sub", end, start)
    mode = b.attr_int("rotary_mode")
    idx = b.op("Range", b.const(0), b.scalar(length), b.const(1))
    half = b.op("Div", length, b.ints(2))
    quarter = b.op("Div", length, b.ints(4))
    one = b.ints(1)
    safe_len, safe_half = b.op("Max", length, one), b.op("Max", half, one)
    in_half = b.op("Mod", idx, safe_half)
    odd = b.op("Equal", b.op("Mod", idx, b.ints(2)), b.ints(1))
    first_half = b.op("Less", idx, half)
    partner0 = b.op("Mod", b.op("Add", idx, half), safe_len)
    partner1 = b.op("Sub", b.op("Add", idx, one), b.op("Mul", b.op("Mod", idx, b.ints(2)), b.ints(2)))
    partner2 = b.op("Add", b.op("Sub", idx, in_half), b.op("Mod", b.op("Add", in_half, quarter), safe_half))
    plus, minus = b.f32(1.0), b.f32(-1.0)
    sign0 = b.where(first_half, plus, minus)
    sign1 = b.where(odd, minus, plus)
    sign2 = b.where(b.op("Less", in_half, quarter), plus, minus)
    is1, is2, is3 = (b.op("Equal", mode, b.const(k)) for k in (1, 2, 3))
    partner = b.where(is1, partner1, b.where(is2, partner2, partner0))
    sign = b.where(is1, sign1, b.where(is2, sign2, sign0))
    g = b.slice(b.to_float(x), start, end, 3)
    zero = b.ints(0)      # cos/sin hold L values; with L = 0 their last dim is free: take [:L]
    c, n = (b.slice(b.to_float(t), zero, length, 3) for t in ("cos", "sin"))
    # an identity's cos/sin need not broadcast onto x (any shape, even empty): read them as (1, 1, 1, 0)
    c, n = (b.op("Reshape", t, b.where(noop, b.ints(1, 1, 1, 0), b.op("Shape", t)), allowzero=1) for t in (c, n))
    if is_grad:
        m = b.op("Mul", sign, b.op("Gather", n, partner, axis=3))        # the partner's sin
        y = b.op("Add", b.op("Mul", c, g), b.op("Mul", m, b.op("Gather", g, partner, axis=3)))
        interleave = b.where(odd, b.op("Add", half, b.op("Div", idx, b.ints(2))), b.op("Div", idx, b.ints(2)))
        y = b.op("Gather", y, b.where(is3, interleave, idx), axis=3)     # mode 3 writes interleaved
    else:
        deinterleave = b.where(first_half, b.op("Mul", idx, b.ints(2)),
                               b.op("Add", b.op("Mul", b.op("Sub", idx, half), b.ints(2)), one))
        g = b.op("Gather", g, b.where(is3, deinterleave, idx), axis=3)   # mode 3 reads interleaved
        m = b.op("Mul", b.op("Neg", sign), n)
        y = b.op("Add", b.op("Mul", c, g), b.op("Mul", m, b.op("Gather", g, partner, axis=3)))
    prefix = b.slice(x, b.ints(0), start, 3)
    suffix = b.slice(x, end, d, 3)
    b.output("Concat", out, prefix, b.op("CastLike", y, x), suffix, axis=3)


@register_lowering(FORWARD)
def rotary_forward(b: Body, spec: LoweringSpec) -> None:
    _rotary_body(b, "x", spec.out("x"), is_grad=False)


@register_lowering(GRAD)
def rotary_grad(b: Body, spec: LoweringSpec) -> None:
    _rotary_body(b, "dy", spec.out("dy"), is_grad=True)

