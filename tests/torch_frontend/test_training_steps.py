"""Training steps through geir.torch: three model pieces written as NPU model code writes them (a DeepSeek-style MoE
layer, a DeepSeek-V3.2-style sparse attention layer, a rope step with the in-place rotary), each run as forward, loss
and backward under every mode of ``helpers.MODES`` and compared with the same math in float64 plain PyTorch: the
output, the loss and every parameter and input gradient, within a tolerance for the model's dtype."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import geir.torch as gt  # noqa: E402
from torch._dynamo.exc import BackendCompilerFailed  # noqa: E402

from .helpers import compiled, mode_params  # noqa: E402

Tensor = torch.Tensor
F = torch.nn.functional

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""Largest error allowed, relative to the reference tensor's largest magnitude (a few roundings of the dtype)."""


def _close(got: Tensor, want: Tensor, dtype: torch.dtype, name: str) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    scale = want.abs().max().item()
    error = (got.detach().double() - want.detach()).abs().max().item() / (scale or 1.0)
    assert error <= TOLERANCE[dtype], f"{name} ({dtype}): relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


def _parameter(g: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...], fan_in: int) -> torch.nn.Parameter:
    return torch.nn.Parameter((torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(dtype))


def _train(module: torch.nn.Module, inputs: dict[str, Tensor], target: Tensor, mode: str) -> tuple[Any, Tensor,
                                                                                                  dict[str, Tensor]]:
    """One training step of ``module`` under ``mode``: (its outputs, the loss, the gradient of every parameter and
    floating input). The loss is the mean squared error of the first output against ``target``, in float32 at least."""
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs.values()]

    def forward_loss(*xs: Tensor) -> tuple[Any, Tensor]:
        out = module(*xs)
        first = out[0] if isinstance(out, tuple) else out
        wide = torch.promote_types(first.dtype, torch.float32)
        return out, F.mse_loss(first.to(wide), target.to(wide))

    # the MoE's per-expert counts (.tolist()): symbolic under inductor; geir compiles static graphs around them
    with torch._dynamo.config.patch(capture_scalar_outputs=mode != "geir"):
        out, loss = compiled(forward_loss, mode)(*leaves)
    loss.backward()
    grads = {name: p.grad for name, p in module.named_parameters() if p.requires_grad}
    grads.update({name: t.grad for name, t in zip(inputs, leaves) if t.requires_grad})
    return out, loss, grads


def _reference(module: torch.nn.Module, inputs: dict[str, Tensor], target: Tensor,
               math_of: Callable[..., Tensor], *extra: Any) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``math_of(params, *inputs, *extra)`` in float64 from the module's own parameter values: (output, loss, grads)."""
    params = {name: p.detach().double().requires_grad_(p.requires_grad) for name, p in module.named_parameters()}
    leaves = {name: t.double().requires_grad_() if t.is_floating_point() else t for name, t in inputs.items()}
    out = math_of(params, *leaves.values(), *extra)
    loss = F.mse_loss(out, target.double())
    loss.backward()
    grads = {name: t.grad for name, t in {**params, **leaves}.items() if t.requires_grad}
    return out, loss, grads


def _compare(got: tuple[Tensor, Tensor, dict[str, Tensor]], want: tuple[Tensor, Tensor, dict[str, Tensor]],
             dtype: torch.dtype) -> None:
    (out, loss, grads), (ref_out, ref_loss, ref_grads) = got, want
    _close(out, ref_out, dtype, "output")
    _close(loss, ref_loss, dtype, "loss")
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in grads.items():
        assert grad is not None, f"d {name}: no gradient reached it"
        assert grad.dtype == dtype, f"d {name}: dtype {grad.dtype}, expected {dtype}"
        _close(grad, ref_grads[name], dtype, f"d {name}")


# -- 1. DeepSeek-style MoE layer: router, permute, experts on their row blocks, unpermute with probs -------------------

T, HIDDEN, FFN, EXPERTS, TOPK = 24, 16, 32, 4, 2


class MoELayer(torch.nn.Module):
    """Routed SwiGLU experts as NPU model code writes them (MindSpeed's permute/unpermute dispatcher): a float32
    router, softmax top-k renormalised, tokens permuted into expert order, each expert on its block of rows (counts by
    ``histc``, as MindSpeed counts them), the rows unpermuted and weighted by the routing probabilities, cast to the
    tokens' dtype as MindSpeed casts them (bfloat16 rows with float32 probs is MG-W2: NaN on the 910 devices)."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.router = _parameter(g, dtype, (EXPERTS, HIDDEN), HIDDEN)
        self.gate = _parameter(g, dtype, (EXPERTS, HIDDEN, FFN), HIDDEN)
        self.up = _parameter(g, dtype, (EXPERTS, HIDDEN, FFN), HIDDEN)
        self.down = _parameter(g, dtype, (EXPERTS, FFN, HIDDEN), FFN)

    def forward(self, tokens: Tensor) -> Tensor:
        scores = torch.softmax(F.linear(tokens.float(), self.router.float()), dim=-1)
        probs, experts = torch.topk(scores, TOPK, dim=-1)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        rows, sorted_indices = gt.npu_moe_token_permute(tokens, experts.to(torch.int32))
        counts = torch.histc(experts.flatten().float(), bins=EXPERTS, min=0, max=EXPERTS).long().tolist()
        blocks = [(F.silu(block @ self.gate[e]) * (block @ self.up[e])) @ self.down[e]
                  for e, block in enumerate(torch.split(rows, counts))]
        return gt.npu_moe_token_unpermute(torch.cat(blocks), sorted_indices, probs.to(tokens.dtype))


def _moe_math(p: dict[str, Tensor], tokens: Tensor) -> Tensor:
    """Every token's top-k experts applied to it directly, weighted by the renormalised probabilities."""
    probs, experts = torch.topk(torch.softmax(tokens @ p["router"].T, dim=-1), TOPK, dim=-1)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for k in range(TOPK):
        e = experts[:, k]
        hidden = F.silu(torch.einsum("th,thf->tf", tokens, p["gate"][e])) * torch.einsum("th,thf->tf", tokens,
                                                                                          p["up"][e])
        out = out + probs[:, k:k + 1] * torch.einsum("tf,tfh->th", hidden, p["down"][e])
    return out


@pytest.mark.parametrize("mode", mode_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_moe_layer_trains_as_its_float64_reference(dtype, mode):
    g = torch.Generator().manual_seed(1)
    inputs = {"tokens": torch.randn(T, HIDDEN, generator=g).to(dtype)}
    target = torch.randn(T, HIDDEN, generator=g)
    module = MoELayer(dtype)
    got = _train(module, inputs, target, mode)
    _compare(got, _reference(module, inputs, target, _moe_math), dtype)
    assert all(grad.abs().sum() > 0 for grad in got[2].values())   # the router's through probs, the rest through rows


# -- 2. DeepSeek-V3.2-style sparse attention: indexer top-k -> npu_sparse_flash_attention (BSND, mode 3, lse) ---------

B, S, MODEL, HEADS, HEAD_DIM, INDEX_HEADS, INDEX_DIM, SELECTED = 2, 10, 32, 4, 16, 2, 8, 4


class SparseAttention(torch.nn.Module):
    """Multi-query sparse attention as DeepSeek-V3.2 model code writes it: a light indexer scores every visible key
    (``sum_h w_h * relu(q_h . k)``, causal) and keeps the top ``SELECTED`` positions (-1 where fewer are visible);
    ``npu_sparse_flash_attention`` attends to those (one KV head, sparse_mode 3, softmax statistics for the
    backward); an output projection. The indexer is not trained through this loss (its top-k is not differentiable)."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.wq = _parameter(g, dtype, (HEADS * HEAD_DIM, MODEL), MODEL)
        self.wk = _parameter(g, dtype, (HEAD_DIM, MODEL), MODEL)
        self.wv = _parameter(g, dtype, (HEAD_DIM, MODEL), MODEL)
        self.wo = _parameter(g, dtype, (MODEL, HEADS * HEAD_DIM), HEADS * HEAD_DIM)
        self.index_q = _parameter(g, dtype, (INDEX_HEADS * INDEX_DIM, MODEL), MODEL).requires_grad_(False)
        self.index_k = _parameter(g, dtype, (INDEX_DIM, MODEL), MODEL).requires_grad_(False)
        self.index_w = _parameter(g, dtype, (INDEX_HEADS, MODEL), MODEL).requires_grad_(False)

    def indexer(self, x: Tensor) -> Tensor:
        """(B, S, 1, SELECTED) int32 key positions, best first, -1 padding."""
        scores = _index_scores(x.detach(), self.index_q, self.index_k, self.index_w)
        best, positions = torch.topk(scores, SELECTED, dim=-1)
        return torch.where(best == float("-inf"), -1, positions).to(torch.int32).unsqueeze(2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, s, _ = x.shape
        q = F.linear(x, self.wq).view(b, s, HEADS, HEAD_DIM)
        k = F.linear(x, self.wk).view(b, s, 1, HEAD_DIM)
        v = F.linear(x, self.wv).view(b, s, 1, HEAD_DIM)
        indices = self.indexer(x)
        out, _, _ = gt.npu_sparse_flash_attention(q, k, v, indices, HEAD_DIM ** -0.5, layout_query="BSND",
                                                  layout_kv="BSND", sparse_mode=3, return_softmax_lse=True)
        return F.linear(out.reshape(b, s, HEADS * HEAD_DIM), self.wo), indices


def _index_scores(x: Tensor, wq: Tensor, wk: Tensor, ww: Tensor) -> Tensor:
    b, s, _ = x.shape
    q = F.linear(x, wq).view(b, s, INDEX_HEADS, INDEX_DIM)
    scores = torch.einsum("bshd,btd->bsht", q, F.linear(x, wk)).relu()
    scores = torch.einsum("bsht,bsh->bst", scores, F.linear(x, ww))
    future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    return scores.masked_fill(future, float("-inf"))


def _attention_math(p: dict[str, Tensor], x: Tensor, indices: Tensor) -> Tensor:
    """Dense attention of each query over the key positions ``indices`` selects, in float64."""
    b, s, _ = x.shape
    q = (x @ p["wq"].T).view(b, s, HEADS, HEAD_DIM)
    k, v = x @ p["wk"].T, x @ p["wv"].T
    chosen = indices[:, :, 0].long()
    visible = (F.one_hot(chosen.clamp(min=0), s) * (chosen >= 0)[..., None]).sum(-2).bool()   # (B, S, S)
    scores = torch.einsum("bqhd,bkd->bhqk", q, k) * HEAD_DIM ** -0.5
    probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkd->bqhd", probs, v).reshape(b, s, HEADS * HEAD_DIM)
    return out @ p["wo"].T


def _check_selection(module: SparseAttention, x: Tensor, indices: Tensor, dtype: torch.dtype) -> None:
    """The indexer's choice is causal, padded with -1 exactly where fewer than SELECTED keys are visible, and a top-k
    of the float64 index scores (ties and the dtype's rounding aside)."""
    assert indices.shape == (B, S, 1, SELECTED) and indices.dtype == torch.int32
    rows = indices[:, :, 0].long()
    query = torch.arange(S)[None, :, None]
    assert bool(((rows <= query) & (rows >= -1)).all())
    assert torch.equal((rows >= 0).sum(-1), torch.clamp(torch.arange(S) + 1, max=SELECTED).expand(B, S))
    scores = _index_scores(x.double(), *(w.detach().double() for w in (module.index_q, module.index_k,
                                                                        module.index_w)))
    picked = scores.gather(-1, rows.clamp(min=0)).masked_fill(rows < 0, float("inf")).amin(-1)
    unpicked = scores.scatter(-1, rows.clamp(min=0), float("-inf")).amax(-1)
    slack = 4 * TOLERANCE[dtype] * scores.masked_fill(scores.isinf(), 0).abs().amax()
    assert bool((picked >= unpicked - slack).all())


@pytest.mark.parametrize("mode", mode_params())
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_sparse_attention_layer_trains_as_its_float64_reference(dtype, mode):
    """float64 is the kernels' test path (the op takes float16 and bfloat16), checked tightly; the others to their
    rounding (the probabilities are rounded to the dtype before P @ V, as the op does)."""
    g = torch.Generator().manual_seed(2)
    inputs = {"x": torch.randn(B, S, MODEL, generator=g).to(dtype)}
    target = torch.randn(B, S, MODEL, generator=g)
    module = SparseAttention(dtype)
    if mode == "geir" and dtype == torch.float64:   # a geir graph holds what CANN's op takes: it refuses float64
        with pytest.raises(BackendCompilerFailed, match=r"\[SCH-5\] SparseFlashAttention .*got float64"):
            _train(module, inputs, target, mode)
        return
    (out, indices), loss, grads = _train(module, inputs, target, mode)
    _check_selection(module, inputs["x"], indices, dtype)
    _compare((out, loss, grads), _reference(module, inputs, target, _attention_math, indices), dtype)
    assert all(p.grad is None for p in (module.index_q, module.index_k, module.index_w))


# -- 3. Rope step: q and k rotated on a partial slice by the in-place kernel (autograd.Function) or the functional op --

ROPE_B, ROPE_S, ROPE_HEADS, ROPE_DIM, ROPE_SLICE = 2, 6, 2, 24, (8, 24)


class InplaceRotary(torch.autograd.Function):
    """The in-place kernel in training, as model code wraps it: forward rotates a copy in place (autograd keeps x),
    backward rotates a copy of the incoming gradient with ``inplace_partial_rotary_mul_backward``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, rotary_mode: str, partial_slice: list[int]) -> Tensor:
        out = x.clone()
        gt.inplace_partial_rotary_mul(out, cos, sin, rotary_mode=rotary_mode, partial_slice=partial_slice)
        ctx.save_for_backward(cos, sin)
        ctx.rotary_mode, ctx.partial_slice = rotary_mode, partial_slice
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        dx = grad.clone(memory_format=torch.contiguous_format)
        gt.inplace_partial_rotary_mul_backward(dx, cos, sin, rotary_mode=ctx.rotary_mode,
                                               partial_slice=ctx.partial_slice)
        return dx, None, None, None, None


def _rope_tables(rotary_mode: str) -> tuple[Tensor, Tensor]:
    """float32 (1, S, 1, L) cos/sin laid out for the mode: one angle per rotated pair, at both its positions."""
    length = ROPE_SLICE[1] - ROPE_SLICE[0]
    inv_freq = 10000.0 ** (-torch.arange(length // 2, dtype=torch.float64) / (length // 2))
    theta = torch.arange(ROPE_S, dtype=torch.float64)[:, None] * inv_freq                 # (S, L/2)
    if rotary_mode == "interleave":
        angles = theta.repeat_interleave(2, dim=-1)
    elif rotary_mode == "quarter":
        first, second = theta.chunk(2, dim=-1)
        angles = torch.cat([first, first, second, second], dim=-1)
    else:                                   # half; interleave-half reads interleaved pairs, rotates in half layout
        angles = torch.cat([theta, theta], dim=-1)
    return angles.cos().float()[None, :, None], angles.sin().float()[None, :, None]


class RopeStep(torch.nn.Module):
    """q and k projections, the rotary on the head dim's tail ``ROPE_SLICE`` (MLA's rope part), attention scores."""

    def __init__(self, dtype: torch.dtype, rotary_mode: str, in_place: bool, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.wq = _parameter(g, dtype, (ROPE_HEADS * ROPE_DIM, HIDDEN), HIDDEN)
        self.wk = _parameter(g, dtype, (ROPE_HEADS * ROPE_DIM, HIDDEN), HIDDEN)
        cos, sin = _rope_tables(rotary_mode)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.rotary_mode, self.in_place = rotary_mode, in_place

    def rotate(self, x: Tensor) -> Tensor:
        if self.in_place:
            return InplaceRotary.apply(x, self.cos, self.sin, self.rotary_mode, list(ROPE_SLICE))
        return gt.partial_rotary_mul(x, self.cos, self.sin, rotary_mode=self.rotary_mode,
                                     partial_slice=list(ROPE_SLICE))

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.rotate(F.linear(x, self.wq).view(b, s, ROPE_HEADS, ROPE_DIM))
        k = self.rotate(F.linear(x, self.wk).view(b, s, ROPE_HEADS, ROPE_DIM))
        return torch.einsum("bsnd,btnd->bnst", q, k) * ROPE_DIM ** -0.5


def _rotate_math(x: Tensor, cos: Tensor, sin: Tensor, rotary_mode: str) -> Tensor:
    """The rotary of ``x[..., s:e]`` written from the pairs of each mode (spec 2.4), the rest unchanged."""
    start, end = ROPE_SLICE
    part = x[..., start:end]
    if rotary_mode == "interleave-half":
        part, rotary_mode = torch.cat([part[..., 0::2], part[..., 1::2]], dim=-1), "half"
    if rotary_mode == "half":
        first, second = part.chunk(2, dim=-1)
        partner = torch.cat([-second, first], dim=-1)
    elif rotary_mode == "interleave":
        partner = torch.stack([-part[..., 1::2], part[..., 0::2]], dim=-1).flatten(-2)
    else:
        c1, c2, c3, c4 = part.chunk(4, dim=-1)
        partner = torch.cat([-c2, c1, -c4, c3], dim=-1)
    rotated = part * cos.double() + partner * sin.double()
    return torch.cat([x[..., :start], rotated, x[..., end:]], dim=-1)


def _rope_math(p: dict[str, Tensor], x: Tensor, rotary_mode: str, cos: Tensor, sin: Tensor) -> Tensor:
    b, s, _ = x.shape
    q = _rotate_math((x @ p["wq"].T).view(b, s, ROPE_HEADS, ROPE_DIM), cos, sin, rotary_mode)
    k = _rotate_math((x @ p["wk"].T).view(b, s, ROPE_HEADS, ROPE_DIM), cos, sin, rotary_mode)
    return torch.einsum("bsnd,btnd->bnst", q, k) * ROPE_DIM ** -0.5


@pytest.mark.parametrize("mode", mode_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("in_place", [True, False], ids=["inplace-function", "functional"])
@pytest.mark.parametrize("rotary_mode", sorted(gt.ROTARY_MODES))
def test_rope_step_trains_as_its_float64_reference(rotary_mode, in_place, dtype, mode):
    g = torch.Generator().manual_seed(3)
    inputs = {"x": torch.randn(ROPE_B, ROPE_S, HIDDEN, generator=g).to(dtype)}
    target = torch.randn(ROPE_B, ROPE_HEADS, ROPE_S, ROPE_S, generator=g)
    module = RopeStep(dtype, rotary_mode, in_place)
    got = _train(module, inputs, target, mode)
    want = _reference(module, inputs, target, _rope_math, rotary_mode, module.cos, module.sin)
    _compare(got, want, dtype)
