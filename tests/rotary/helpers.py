"""What the rotary family's tests share: the op names, a one-node graph builder, the ropes exporters write
(rotate_half, rotate_every_two: what geir.fuse turns into the op) and the graph the VJP tests differentiate."""

from __future__ import annotations

import pytest

import geir
from helpers import BIG, ints, onnx_slice

ROPE, ROPE_GRAD = "InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"

empty_grad_slices_expected = pytest.mark.filterwarnings(r"ignore:\[RP-W1\]:geir.GeirWarning")
"""For tests that build rotary grads with an empty slice on purpose (the RP-W1 warning has its own test)."""


def rotary_graph(op: str, x_shape, cos_shape, dtype="float32", cos_dtype=None, name: str = "node", **attrs):
    """A one-node rotary graph with inputs x, cos, sin and output y."""
    b = geir.GraphBuilder("g")
    x = b.input("x", dtype, x_shape)
    cos = b.input("cos", cos_dtype or dtype, cos_shape)
    sin = b.input("sin", cos_dtype or dtype, cos_shape)
    b.output(getattr(b, op)(x, cos, sin, name=name, **attrs), "y")
    return b.build()


def rotate_half(b, x, d, split=False):
    """Llama's rotate_half of the last axis of ``x`` (length ``d``): two Slices, or one Split."""
    if split:
        x1, x2 = b.op("Split", x, axis=-1, num_outputs=2)
    else:
        x1, x2 = onnx_slice(b, x, 0, d // 2), onnx_slice(b, x, d // 2, BIG)
    return b.op("Concat", b.op("Neg", x2), x1, axis=-1)


def rotate_every_two(b, x, shape):
    """GPT-J's rotate_every_two of the last axis: strided Slices stacked and flattened back to ``shape``."""
    odd, even = onnx_slice(b, x, 1, BIG, 2), onnx_slice(b, x, 0, BIG, 2)
    stacked = b.op("Concat", b.op("Unsqueeze", b.op("Neg", odd), ints(b, [-1])),
                   b.op("Unsqueeze", even, ints(b, [-1])), axis=-1)
    return b.op("Reshape", stacked, ints(b, list(shape)))


def rope_subgraph(kind: str, shape=(2, 4, 3, 8), table=(1, 4, 1, 8), dtype="float32"):
    """A rope of standard ops, as exporters write it: ``kind`` half, half_split_commuted, interleaved (forward),
    half_backward, interleaved_backward (the grad's form); inputs x, cos, sin, output y."""
    b = geir.GraphBuilder(kind)
    x = b.input("x", dtype, shape)
    cos = b.input("cos", dtype, table)
    sin = b.input("sin", dtype, table)
    d = shape[-1]
    if kind == "half":
        y = b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotate_half(b, x, d), sin))
    elif kind == "half_split_commuted":
        y = b.op("Add", b.op("Mul", sin, rotate_half(b, x, d, split=True)), b.op("Mul", cos, x))
    elif kind == "interleaved":
        y = b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotate_every_two(b, x, shape), sin))
    elif kind == "interleaved_backward":
        m = b.op("Mul", x, sin)
        odd, even = onnx_slice(b, m, 1, BIG, 2), onnx_slice(b, m, 0, BIG, 2)
        stacked = b.op("Concat", b.op("Unsqueeze", odd, ints(b, [-1])),
                       b.op("Unsqueeze", b.op("Neg", even), ints(b, [-1])), axis=-1)
        y = b.op("Add", b.op("Mul", x, cos), b.op("Reshape", stacked, ints(b, list(shape))))
    elif kind == "half_backward":
        m = b.op("Mul", x, sin)
        moved = b.op("Concat", onnx_slice(b, m, d // 2, BIG), b.op("Neg", onnx_slice(b, m, 0, d // 2)), axis=-1)
        y = b.op("Add", b.op("Mul", x, cos), moved)
    else:
        raise ValueError(kind)
    b.output(y, "y")
    return b.build()


def rotary_vjp_graph(op, mode, shape, cos_shape, pslice, dtype="float32", cos_dtype="float32"):
    """One rotary node to differentiate: the forward's y squared (its VJP then depends on x, cos and sin), the grad
    op's y as it is; inputs x, cos, sin, output y."""
    b = geir.GraphBuilder("rope")
    x = b.input("x", dtype, shape)
    c = b.input("cos", cos_dtype, cos_shape)
    s = b.input("sin", cos_dtype, cos_shape)
    y = getattr(b, op)(x, c, s, rotary_mode=mode, partial_slice=pslice)
    b.output(b.op("Mul", y, y) if op == "InplacePartialRotaryMul" else y, "y")
    return b.build()
