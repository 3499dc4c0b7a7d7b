"""geir.grad through the MoE unpermute ops: the forward's and the grad op's VJPs against finite differences of the
float64 reference, and a forward mixing nodes with and without probs, whose derivative exports and runs everywhere."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir.testing import reference
from helpers import directional_error, ints, uniform_feeds
from moe.helpers import moe_vjp_graph


@pytest.mark.parametrize("rows, slots, probs_shape", [(6, 6, (3, 2)), (6, 6, None), (4, 6, (3, 2)), (8, 6, (2, 3))])
def test_moe_forward_vjp(rows, slots, probs_shape):
    graph = moe_vjp_graph(rows, slots, probs_shape)
    feeds = uniform_feeds(graph)
    feeds["indices"] = np.random.default_rng(3).permutation(slots).astype(np.int32)
    assert directional_error(graph, feeds) < 1e-7
    assert "MoeTokenUnpermuteGrad" in [n.op_type for n in geir.grad(graph).nodes]


def test_moe_grad_op_vjp_through_every_input():
    graph = moe_vjp_graph(6, 6, (3, 2), grad_op=True)
    feeds = uniform_feeds(graph)
    feeds["indices"] = np.array([3, 0, 5, 1, 4, 2], np.int32)
    assert directional_error(graph, feeds) < 1e-7
    ops = [n.op_type for n in geir.grad(graph).nodes]
    assert ops.count("MoeTokenUnpermute") == 2 and ops.count("MoeTokenUnpermuteGrad") == 3 and "Gather" not in ops


def _moe_mixed(kind: str) -> geir.Graph:
    """A forward holding MoE nodes with and without probs (each op in one form: the forward exports)."""
    b = geir.GraphBuilder("moe_mixed")
    tokens = b.input("tokens", "float32", (6, 4))
    indices = b.constant("indices", np.array([3, 0, 5, 1, 4, 2], np.int32))
    probs = b.input("probs", "float32", (3, 2))
    if kind == "unpermute without probs, grad with":
        rows = b.MoeTokenUnpermute(tokens, indices)                                           # (6, 4)
        dy = b.op("Slice", rows, ints(b, [0], "s"), ints(b, [3], "e"))                       # (3, 4)
        ptg, pg = b.MoeTokenUnpermuteGrad(tokens, b.op("Mul", dy, dy), indices, probs)
    else:
        out = b.MoeTokenUnpermute(tokens, indices, probs)                                      # (3, 4)
        dy = b.op("Concat", out, b.op("Mul", out, out), axis=0)                               # (6, 4)
        ptg, pg = b.MoeTokenUnpermuteGrad(tokens if kind == "grad with tokens, without probs" else None, dy,
                                          indices)
    b.output(b.op("Mul", ptg, ptg), "ptg")
    b.output(pg, "pg")
    return b.build()


@pytest.mark.parametrize("kind", ["unpermute without probs, grad with", "grad without tokens or probs",
                                  "grad with tokens, without probs"])
def test_moe_vjp_of_a_forward_mixing_probs_and_none_exports_and_runs_everywhere(kind):
    """The VJPs of nodes with probs write MoE nodes with probs, those without probs nodes without: the derivative held
    two forms of one op, which ONNX export refuses (found by the random graphs: it ran on NumPy only). Now every MoE
    node of such a derivative has probs (ones, and zero tokens for the grad): same values, one form per op."""
    graph = _moe_mixed(kind)
    geir.to_onnx(graph)                                       # the forward exports
    derivative = geir.grad(graph, outputs=["ptg"])
    import onnx
    onnx.checker.check_model(geir.to_onnx(derivative), full_check=True)
    feeds = uniform_feeds(graph)
    assert directional_error(graph, feeds) < 1e-7
    cotangent = {"grad_ptg": np.random.default_rng(2).standard_normal((6, 4)).astype(np.float32)}
    forward = geir.run(graph, feeds, runtime="numpy")
    want = reference(derivative, {**feeds, **cotangent}, rounded=False)
    for runtime in ("numpy", "onnxruntime"):
        got = geir.run(derivative, {**feeds, **cotangent}, runtime=runtime)
        for name in ("ptg", "pg"):
            np.testing.assert_allclose(got[name], forward[name], rtol=1e-6, atol=1e-6, err_msg=name)
        for name in ("grad_tokens", "grad_probs"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=f"{runtime} {name}")
