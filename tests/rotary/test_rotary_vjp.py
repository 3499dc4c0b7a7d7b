"""geir.grad through the rotary ops: the forward's VJP covers x, cos and sin and emits the grad op, the grad op's VJP
is the forward; both against finite differences of the float64 reference."""

from __future__ import annotations

import pytest

import geir
from helpers import directional_error, uniform_feeds
from rotary.helpers import rotary_vjp_graph


@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("cos_shape", [(1, 3, 1, 8), (2, 3, 4, 8), (2, 1, 1, 8)])
def test_rotary_forward_vjp_covers_x_cos_and_sin(mode, cos_shape):
    graph = rotary_vjp_graph("InplacePartialRotaryMul", mode, (2, 3, 4, 12), cos_shape, [2, 10])
    assert directional_error(graph, uniform_feeds(graph)) < 1e-7
    ops = [n.op_type for n in geir.grad(graph).nodes]
    assert "InplacePartialRotaryMulGrad" in ops


@pytest.mark.parametrize("mode", range(4))
def test_rotary_grad_op_vjp_is_the_forward(mode):
    graph = rotary_vjp_graph("InplacePartialRotaryMulGrad", mode, (1, 2, 2, 8), (1, 2, 1, 8), [0, 8],
                             cos_dtype="float16")
    assert directional_error(graph, uniform_feeds(graph), wrt=["x"]) < 1e-7
    ops = [n.op_type for n in geir.grad(graph, wrt=["x"]).nodes]
    assert ops.count("InplacePartialRotaryMul") == 1
    with pytest.raises(geir.GraphError, match=r"no cotangent for input 1 'cos'"):
        geir.grad(graph)                     # cos of the grad op: not linear there, never a silent zero
