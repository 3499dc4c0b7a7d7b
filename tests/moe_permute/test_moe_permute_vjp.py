"""geir.grad through MoeTokenPermute(Grad): each op's VJP is the other (against finite differences of the float64
reference), and a permute -> per-expert MLP -> unpermute step whose derivative equals torch autograd of the same
step, on both runtimes."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from helpers import directional_error, ints, uniform_feeds
from moe_permute.helpers import routing


def _permute_squared(tokens_shape, ids, **attrs) -> geir.Graph:
    b = geir.GraphBuilder("permute_vjp")
    x = b.input("x", "float32", tokens_shape)
    rows, _ = b.MoeTokenPermute(x, b.constant("ids", ids), **attrs)
    b.output(b.op("Mul", rows, rows), "y")
    return b.build()


@pytest.mark.parametrize("shape, topk, n", [((6, 4), 2, 0), ((6, 4), 3, -5), ((5, 2, 3), 1, 0), ((4, 3), 2, 3)])
def test_permute_vjp_is_the_permute_grad(shape, topk, n):
    rng = np.random.default_rng(topk)
    ids = routing(rng, shape[0], topk, 4, distinct=False)
    graph = _permute_squared(shape, ids if topk > 1 else ids[:, 0], num_out_tokens=n)
    assert directional_error(graph, uniform_feeds(graph)) < 1e-7
    assert "MoeTokenPermuteGrad" in [node.op_type for node in geir.grad(graph).nodes]


@pytest.mark.parametrize("rows", [5, 8, 10])
def test_permute_grad_vjp_is_a_permute(rows):
    """R < M (dropped rows), R == M, and R > M (rows no slot reads: zero cotangent)."""
    b = geir.GraphBuilder("grad_vjp")
    g = b.input("g", "float32", (rows, 3))
    s = b.constant("s", np.array([2, 5, 0, 3, 1, 6, 4, 7], np.int32))
    dx = b.MoeTokenPermuteGrad(g, s, num_topk=2)
    b.output(b.op("Mul", dx, dx), "y")
    graph = b.build()
    assert directional_error(graph, uniform_feeds(graph)) < 1e-7
    assert "MoeTokenPermute" in [node.op_type for node in geir.grad(graph).nodes]


T, K, H, E = 6, 2, 4, 3


def _moe_step(ids: np.ndarray) -> geir.Graph:
    """permute -> expert e's rows through tanh(rows @ W_e) -> unpermute weighted by probs (ids constant: the rows of
    each expert are a static slice of the permuted tokens)."""
    counts = np.bincount(ids.reshape(-1), minlength=E)
    b = geir.GraphBuilder("moe_step")
    x, probs = b.input("x", "float32", (T, H)), b.input("probs", "float32", (T, K))
    weights = [b.input(f"w{e}", "float32", (H, H)) for e in range(E)]
    rows, s = b.MoeTokenPermute(x, b.constant("ids", ids))
    chunks = b.op("Split", rows, ints(b, list(counts), "counts"), axis=0, outputs=E)
    hidden = [b.op("Tanh", b.op("MatMul", chunk, w)) for chunk, w in zip(chunks, weights)]
    b.output(b.MoeTokenUnpermute(b.op("Concat", *hidden, axis=0), s, probs), "y")
    return b.build()


def _torch_step(x, probs, weights, ids):
    import torch

    flat = torch.as_tensor(ids).reshape(-1)
    row2slot = torch.argsort(flat, stable=True)
    rows = x.index_select(0, row2slot // K)
    counts = torch.bincount(flat, minlength=E).tolist()
    hidden = torch.cat([torch.tanh(c @ w) for c, w in zip(torch.split(rows, counts), weights)])
    sorted_indices = torch.argsort(row2slot)
    return (hidden[sorted_indices].reshape(T, K, H) * probs[:, :, None]).sum(1)


@pytest.mark.filterwarnings("ignore")
def test_permute_mlp_unpermute_step_grad_equals_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    ids = routing(rng, T, K, E)
    while np.bincount(ids.reshape(-1), minlength=E).min() == 0:
        ids = routing(rng, T, K, E)
    feeds = {"x": rng.standard_normal((T, H)).astype(np.float32),
             "probs": rng.uniform(0.1, 1, (T, K)).astype(np.float32),
             **{f"w{e}": (rng.standard_normal((H, H)) / 2).astype(np.float32) for e in range(E)}}
    cotangent = rng.standard_normal((T, H)).astype(np.float32)
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    out = _torch_step(leaves["x"], leaves["probs"], [leaves[f"w{e}"] for e in range(E)], ids)
    out.backward(torch.tensor(cotangent, dtype=torch.float64))
    graph = _moe_step(ids)
    np.testing.assert_allclose(geir.run(graph, feeds)["y"], out.detach().numpy(), rtol=1e-5, atol=1e-5)
    derivative = geir.grad(graph)
    ops = [n.op_type for n in derivative.nodes]
    assert "MoeTokenPermuteGrad" in ops and "MoeTokenUnpermuteGrad" in ops
    for runtime in ("numpy", "onnxruntime"):
        got = geir.run(derivative, {**feeds, "grad_y": cotangent}, runtime=runtime)
        for name, leaf in leaves.items():
            np.testing.assert_allclose(got[f"grad_{name}"], leaf.grad.numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{runtime} {name}")
