"""geir.torch.install_npu_shim: an unmodified NPU-style MoE module (MindSpeed's way: ``import torch_npu`` at call
time) trains on the CPU against a float64 PyTorch reference; the shim never shadows a real torch_npu."""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

import geir.torch as gt  # noqa: E402

T, H, F, E, K = 12, 16, 24, 4, 2


class NpuStyleMoE(torch.nn.Module):
    """Written for the NPU, as MindSpeed's MoE token dispatcher is: nothing here knows about geir."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(H, E, generator=g) / H ** 0.5)
        self.w_in = torch.nn.Parameter(torch.randn(E, H, F, generator=g) / H ** 0.5)
        self.w_out = torch.nn.Parameter(torch.randn(E, F, H, generator=g) / F ** 0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        import torch_npu

        scores = torch.softmax(hidden @ self.router, dim=-1)
        probs, indices = torch.topk(scores, K, dim=-1)
        permuted, sorted_indices = torch_npu.npu_moe_token_permute(hidden, indices.to(torch.int32))
        counts = torch.bincount(indices.flatten(), minlength=E).tolist()
        rows = [torch.nn.functional.gelu(chunk @ self.w_in[e]) @ self.w_out[e]
                for e, chunk in enumerate(torch.split(permuted, counts))]
        return torch_npu.npu_moe_token_unpermute(torch.cat(rows), sorted_indices, probs)


def _reference(module: NpuStyleMoE, hidden: torch.Tensor):
    """The same step in float64 PyTorch: every token's top-K experts, weighted by their probabilities."""
    router, w_in, w_out = (p.detach().double().requires_grad_() for p in (module.router, module.w_in, module.w_out))
    x = hidden.detach().double().requires_grad_()
    probs, indices = torch.topk(torch.softmax(x @ router, dim=-1), K, dim=-1)
    out = torch.zeros_like(x)
    for k in range(K):
        e = indices[:, k]
        expert = torch.nn.functional.gelu(torch.einsum("th,thf->tf", x, w_in[e]))
        out = out + probs[:, k:k + 1] * torch.einsum("tf,tfh->th", expert, w_out[e])
    return out, (x, router, w_in, w_out)


@pytest.fixture
def shim():
    with gt.npu_shim() as module:
        yield module
    assert "torch_npu" not in sys.modules


def test_an_unmodified_npu_moe_module_trains_on_the_cpu(shim):
    import torch_npu

    assert torch_npu is shim and torch_npu.npu_moe_token_unpermute is gt.npu_moe_token_unpermute
    assert torch_npu.npu_moe_token_unpermute_grad_v2 is gt.npu_moe_token_unpermute_grad_v2
    module = NpuStyleMoE()
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = module(hidden)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    out.backward(dy)
    ref, leaves = _reference(module, hidden)
    ref.backward(dy.double())
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for got, want in zip((hidden, module.router, module.w_in, module.w_out), leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, **tol)
    assert module.router.grad.abs().sum() > 0      # the probs' gradient reached the router through the unpermute


def test_the_shim_is_explicit_idempotent_and_names_what_it_lacks():
    assert "torch_npu" not in sys.modules           # importing geir.torch installs nothing
    first = gt.install_npu_shim()
    try:
        assert gt.install_npu_shim() is first and sys.modules["torch_npu"] is first
        with pytest.raises(AttributeError, match="npu_fusion_attention.*shim provides"):
            first.npu_fusion_attention  # noqa: B018
    finally:
        assert gt.uninstall_npu_shim() is True
    assert "torch_npu" not in sys.modules and gt.uninstall_npu_shim() is False


def test_the_shim_refuses_when_a_torch_npu_is_already_there(monkeypatch):
    real = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", real)
    with pytest.raises(RuntimeError, match="already imported"):
        gt.install_npu_shim()
    assert gt.uninstall_npu_shim() is False and sys.modules["torch_npu"] is real


def test_the_shim_refuses_when_a_real_torch_npu_is_importable(monkeypatch, tmp_path):
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="real torch_npu is installed"):
        gt.install_npu_shim()
    assert "torch_npu" not in sys.modules
