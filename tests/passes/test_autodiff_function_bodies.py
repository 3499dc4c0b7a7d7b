"""geir.grad through ops ONNX defines by a function body and no rule of ours covers (Attention of opset 23, the
activations and losses of newer opsets): written out as ONNX's body, each is differentiated like any graph, and the
result agrees with float64 central differences; the derivative graph's forward outputs keep their names and values."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.schemas import get_schema
from geir.testing import reference
from helpers import directional_error


def _attention_graph(q_shape, kv_shape, mask: str | None = None, opset: int = 23, **attributes) -> geir.Graph:
    b = geir.GraphBuilder("attention")
    q = b.input("q", "float64", q_shape)
    k = b.input("k", "float64", kv_shape)
    v = b.input("v", "float64", kv_shape)
    inputs = [q, k, v]
    if mask is not None:
        s, t = (q_shape[-2], kv_shape[-2]) if len(q_shape) == 4 else (q_shape[1], kv_shape[1])
        values = np.random.default_rng(7).random((s, t))
        inputs.append(b.constant("mask", values > 0.3 if mask == "bool" else np.log(values)))
    y = b.add_node(get_schema("Attention", "", version=opset), inputs, attributes)
    b.output(y[0] if isinstance(y, tuple) else y, "y")
    return b.build()


ATTENTION = {
    "plain": ((2, 2, 3, 4), (2, 2, 5, 4), None, {}),
    "causal": ((1, 2, 4, 4), (1, 2, 4, 4), None, {"is_causal": 1}),
    "grouped heads, scale": ((1, 4, 3, 4), (1, 2, 5, 4), None, {"scale": 0.3}),
    "softcap": ((1, 2, 3, 4), (1, 2, 5, 4), None, {"softcap": 2.0}),
    "bool mask": ((1, 2, 3, 4), (1, 2, 5, 4), "bool", {}),
    "additive mask, causal": ((1, 2, 3, 4), (1, 2, 5, 4), "float", {"is_causal": 1}),
    "3-D, heads as attributes": ((2, 3, 8), (2, 5, 4), None, {"q_num_heads": 2, "kv_num_heads": 1}),
}


@pytest.mark.parametrize("case", list(ATTENTION))
def test_attention_of_opset_23_is_differentiated_through_its_body(case):
    q_shape, kv_shape, mask, attributes = ATTENTION[case]
    graph = _attention_graph(q_shape, kv_shape, mask, **attributes)
    rng = np.random.default_rng(3)
    feeds = {"q": rng.standard_normal(q_shape), "k": rng.standard_normal(kv_shape), "v": rng.standard_normal(kv_shape)}
    assert directional_error(graph, feeds) < 1e-6
    derivative = geir.grad(graph)
    assert [v.name for v in derivative.outputs] == ["y", "grad_q", "grad_k", "grad_v"]
    want = reference(graph, feeds, rounded=False)["y"]
    got = reference(derivative, {**feeds, "grad_y": np.ones(want.shape)}, rounded=False)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


FUNCTIONS = {   # op, opset where ONNX gives it a body, attributes
    "Softsign": (22, {}), "Mish": (22, {}), "Selu": (22, {}), "Elu": (22, {"alpha": 0.7}), "HardSwish": (22, {}),
    "ThresholdedRelu": (22, {"alpha": 0.1}), "Swish": (24, {"alpha": 1.5}),
}


@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_activations_defined_by_a_body_are_differentiated(op):
    opset, attributes = FUNCTIONS[op]
    b = geir.GraphBuilder(op.lower())
    x = b.input("x", "float64", (2, 3, 4))
    y = b.add_node(get_schema(op, "", version=opset), [x], attributes)
    b.output(y, "y")
    feeds = {"x": (np.random.default_rng(4).uniform(0.2, 2.0, (2, 3, 4)) * np.where(
        np.arange(24).reshape(2, 3, 4) % 3 == 0, -1, 1)).astype(x.type.dtype.numpy)}   # away from the kinks
    assert directional_error(b.build(), feeds) < 1e-6


def test_an_op_without_a_rule_or_a_body_is_still_named():
    b = geir.GraphBuilder("no_body")
    x = b.input("x", "float64", (2, 3))
    b.output(b.op("Hardmax", x), "y")
    with pytest.raises(geir.GraphError, match="no VJP rule for Hardmax"):
        geir.grad(b.build())
