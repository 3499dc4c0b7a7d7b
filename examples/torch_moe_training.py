"""A MoE layer written for the NPU, trained on the CPU: geir.torch stands in for torch_npu.

The module below is NPU model code as MindSpeed writes it (``import torch_npu`` at call time, then
``torch_npu.npu_moe_token_permute`` / ``torch_npu.npu_moe_token_unpermute``); it knows nothing about geir.
``geir.torch.install_npu_shim()`` makes ``import torch_npu`` resolve to geir.torch's functions (the same
signatures, autograd as op-plugin wires it, computed by geir's kernels), so it trains unchanged: a few AdamW steps
on random data, then one step checked against the same math in float64 plain PyTorch.

    python examples/torch_moe_training.py          (needs torch: pip install 'geir[models]')

Exit status 1 if the check's largest relative error exceeds the tolerance.
"""

from __future__ import annotations

import sys

import torch

import geir.torch

F = torch.nn.functional
TOKENS, HIDDEN, FFN, EXPERTS, TOPK, STEPS = 64, 32, 64, 8, 2, 8
TOLERANCE = 1e-4
"""float32 against float64: the largest error allowed, relative to the reference tensor's largest magnitude."""


class NpuMoE(torch.nn.Module):
    """DeepSeek-style routed SwiGLU experts: softmax router, top-k renormalised, tokens permuted into expert order,
    each expert on its block of rows, rows unpermuted and weighted by the routing probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN) / HIDDEN ** 0.5)
        self.gate = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / HIDDEN ** 0.5)
        self.up = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / HIDDEN ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) / FFN ** 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch_npu

        probs, experts = torch.topk(torch.softmax(F.linear(tokens, self.router), dim=-1), TOPK, dim=-1)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        rows, sorted_indices = torch_npu.npu_moe_token_permute(tokens, experts.to(torch.int32))
        counts = torch.histc(experts.flatten().float(), bins=EXPERTS, min=0, max=EXPERTS).long().tolist()
        blocks = [(F.silu(block @ self.gate[e]) * (block @ self.up[e])) @ self.down[e]
                  for e, block in enumerate(torch.split(rows, counts))]
        return torch_npu.npu_moe_token_unpermute(torch.cat(blocks), sorted_indices, probs)


def reference(params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The layer's math without permutation: each token through its top-k experts, weighted by their probabilities."""
    probs, experts = torch.topk(torch.softmax(tokens @ params["router"].T, dim=-1), TOPK, dim=-1)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for k in range(TOPK):
        e = experts[:, k]
        hidden = F.silu(torch.einsum("th,thf->tf", tokens, params["gate"][e])) * torch.einsum(
            "th,thf->tf", tokens, params["up"][e])
        out = out + probs[:, k:k + 1] * torch.einsum("tf,tfh->th", hidden, params["down"][e])
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).abs().max().item() / want.abs().max().item()


def check(model: NpuMoE, tokens: torch.Tensor, target: torch.Tensor) -> float:
    """The largest relative error of one step (output, loss, every parameter's and the tokens' gradient) against
    the float64 reference."""
    model.zero_grad()
    x = tokens.clone().requires_grad_()
    out = model(x)
    loss = F.mse_loss(out, target)
    loss.backward()
    params = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters()}
    x64 = tokens.double().requires_grad_()
    out64 = reference(params, x64)
    loss64 = F.mse_loss(out64, target.double())
    loss64.backward()
    pairs = [(out, out64), (loss, loss64), (x.grad, x64.grad)]
    pairs += [(p.grad, params[name].grad) for name, p in model.named_parameters()]
    return max(relative_error(got, want.detach()) for got, want in pairs)


def main() -> int:
    geir.torch.install_npu_shim()        # `import torch_npu` now finds geir.torch's stand-in (CPU, no NPU stack)
    torch.manual_seed(0)
    model = NpuMoE()
    tokens = torch.randn(TOKENS, HIDDEN)
    target = torch.tanh(tokens @ torch.randn(HIDDEN, HIDDEN) / HIDDEN ** 0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(model(tokens), target)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.6f}")
    error = check(model, tokens, target)
    verdict = "ok" if error <= TOLERANCE else "FAILED"
    print(f"check against float64 PyTorch: max relative error {error:.2e} (tolerance {TOLERANCE:.0e}): {verdict}")
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
