"""What the rotary family's tests share: the op names and a one-node graph builder."""

from __future__ import annotations

import pytest

import geir

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
