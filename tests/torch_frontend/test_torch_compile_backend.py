"""geir.torch.backend(): torch.compile through geir graphs. Forward and backward equal eager PyTorch, the reports say
which CANN ops each graph uses (geir's ops and what geir.fuse made of standard ops), and a graph the target refuses
raises with the rule or, when asked, runs eagerly with a warning."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import geir  # noqa: E402
import geir.torch as gt  # noqa: E402
from torch._dynamo.exc import BackendCompilerFailed  # noqa: E402

pytestmark = pytest.mark.models   # each compile exports two graphs through torch's ONNX exporter: seconds


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(fn, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step: the loss and the gradients of every input that requires one."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves if t.requires_grad]


def _compare(backend: gt.GeirBackend, fn, inputs: list[torch.Tensor], tolerance: float) -> None:
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    loss, grads = _step(compiled, inputs)
    want_loss, want_grads = _step(fn, inputs)
    torch.testing.assert_close(loss, want_loss, rtol=tolerance, atol=tolerance)
    assert len(grads) == len(want_grads)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


class _MoeLayer(torch.nn.Module):
    """Router, permute, one expert MLP shared by all rows, unpermute with probs."""

    def __init__(self, hidden: int = 8, experts: int = 4, topk: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.expert = torch.nn.Linear(hidden, hidden)
        self.topk = topk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, ids = torch.topk(torch.softmax(self.router(x), dim=-1), self.topk)
        rows, sorted_indices = gt.npu_moe_token_permute(x, ids.to(torch.int32))
        y = gt.npu_moe_token_unpermute(torch.nn.functional.silu(self.expert(rows)), sorted_indices, probs)
        return y.square().sum()


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_a_moe_layer_trains_as_in_eager_and_the_reports_name_its_ops(runtime):
    layer = _MoeLayer()
    backend = gt.backend(target="ascend910b", runtime=runtime)
    x = torch.randn(6, 8, requires_grad=True)
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
    loss = compiled(x)
    loss.backward()
    got = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    x.grad = None
    layer.zero_grad()
    want_loss = layer(x)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, [x.grad, *(p.grad for p in layer.parameters())]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    kinds = {r.kind: r for r in backend.reports}
    assert set(kinds) == {"forward", "backward"}
    assert kinds["forward"].cann_ops == {"MoeTokenPermute": 1, "MoeTokenUnpermute": 1}
    assert kinds["backward"].cann_ops == {"MoeTokenPermuteGrad": 1, "MoeTokenUnpermuteGrad": 1}
    assert all(r.check is not None and r.check.ok and r.fallback is None for r in backend.reports)
    assert "MoeTokenUnpermute x1" in str(kinds["forward"]) and "ascend910b: ok" in str(kinds["forward"])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hf_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb, as model code writes it (standard ops only)."""
    return ((q * cos + _rotate_half(q) * sin) ** 2).sum()


def _rope_inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 8, 16, generator=g).requires_grad_()
    return [q, torch.randn(2, 1, 8, 16, generator=g), torch.randn(2, 1, 8, 16, generator=g)]


def test_a_hand_written_rope_is_fused_into_the_cann_op_and_still_equals_eager():
    backend = gt.backend()
    _compare(backend, _hf_rope, _rope_inputs(), 1e-5)
    forward = next(r for r in backend.reports if r.kind == "forward")
    assert forward.cann_ops == {"InplacePartialRotaryMul": 1}
    assert [f.became.split()[0] for f in forward.fusion.fused] == ["InplacePartialRotaryMul"]


def test_a_graph_the_target_refuses_raises_with_the_rule():
    backend = gt.backend(target="ascend910b")   # the fused rope is half mode; this device has interleave only
    compiled = torch.compile(_hf_rope, backend=backend, fullgraph=True, dynamic=False)
    with pytest.raises(BackendCompilerFailed) as caught:
        compiled(*_rope_inputs())
    inner = caught.value.inner_exception
    assert isinstance(inner, geir.GraphError)
    assert "ascend910b refuses the forward graph" in str(inner) and "RP-T2" in str(inner)
    assert backend.reports[0].check is not None and "RP-T2" in backend.reports[0].check.rules()


def test_fallback_runs_the_refused_graph_eagerly_with_a_warning():
    backend = gt.backend(target="ascend910b", fallback=True)
    with pytest.warns(geir.GeirWarning, match="runs eagerly.*RP-T2"):
        _compare(backend, _hf_rope, _rope_inputs(), 1e-6)
    forward = next(r for r in backend.reports if r.kind == "forward")
    assert forward.fallback is not None and "RP-T2" in forward.fallback
    assert str(forward).startswith("forward: eager (fallback")


class _RotaryFunction(torch.autograd.Function):
    """A rope through the in-place kernels, as model code wires an in-place op into autograd."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        y = x.clone()
        gt.inplace_partial_rotary_mul(y, cos, sin, rotary_mode="interleave", partial_slice=[0, 16])
        ctx.save_for_backward(cos, sin)
        return y

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dx = dy.clone()
        gt.inplace_partial_rotary_mul_backward(dx, cos, sin, rotary_mode="interleave", partial_slice=[0, 16])
        return dx, None, None


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")   # dynamo's, not ours
def test_the_in_place_rotary_compiles_to_the_cann_op_pair():
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, 8, 2, 16, generator=g).requires_grad_(), torch.randn(1, 8, 1, 16, generator=g),
              torch.randn(1, 8, 1, 16, generator=g)]
    backend = gt.backend(target="ascend950")   # the only device with the grad kernel (RP-T1)
    _compare(backend, lambda x, c, s: (_RotaryFunction.apply(x, c, s) * 3).sum(), inputs, 1e-6)
    ops = {r.kind: r.cann_ops for r in backend.reports}
    assert ops == {"forward": {"InplacePartialRotaryMul": 1}, "backward": {"InplacePartialRotaryMulGrad": 1}}


def test_a_sparse_attention_layer_trains_as_in_eager():
    g = torch.Generator().manual_seed(4)
    b, s, n, d, k = 1, 8, 2, 16, 4
    q = torch.randn(b, s, n, d, generator=g).half().requires_grad_()
    key = torch.randn(b, s, 1, d, generator=g).half().requires_grad_()
    value = torch.randn(b, s, 1, d, generator=g).half().requires_grad_()
    indices = torch.full((b, s, 1, k), -1, dtype=torch.int32)
    for row in range(s):   # causal top-k: at most k of the keys at or before the row
        chosen = torch.randperm(row + 1, generator=g)[:k]
        indices[0, row, 0, :len(chosen)] = chosen.to(torch.int32)

    def layer(q, key, value, indices):
        out, _, _ = gt.npu_sparse_flash_attention(q, key, value, indices, 0.25, sparse_mode=3,
                                                  return_softmax_lse=True)
        return out.float().square().sum()

    backend = gt.backend()
    _compare(backend, layer, [q, key, value, indices], 1e-3)
    ops = {r.kind: r.cann_ops for r in backend.reports}
    assert ops == {"forward": {"SparseFlashAttention": 1}, "backward": {"SparseFlashAttentionGrad": 1}}


def test_inference_compiles_one_graph():
    layer = _MoeLayer()
    backend = gt.backend()
    x = torch.randn(6, 8)
    with torch.no_grad():
        got = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)(x)
        want = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [r.kind for r in backend.reports] == ["inference"]


def test_dynamic_shapes_are_refused_with_the_remedy_or_fall_back():
    fn = lambda x: (x * 2).sum()   # noqa: E731
    with pytest.raises(BackendCompilerFailed, match="dynamic=False"):
        torch.compile(fn, backend=gt.backend(), dynamic=True)(torch.randn(3, 4))
    torch._dynamo.reset()
    backend = gt.backend(fallback=True)
    with pytest.warns(geir.GeirWarning, match="dynamic sizes"):
        got = torch.compile(fn, backend=backend, dynamic=True)(torch.randn(3, 4).abs())
    assert got > 0 and backend.reports[0].fallback is not None


def test_bad_backend_arguments_fail_when_the_backend_is_made():
    with pytest.raises(geir.GraphError, match="ascend999"):
        gt.backend(target="ascend999")
    with pytest.raises(Exception, match="tensorrt"):
        gt.backend(runtime="tensorrt")


def test_bfloat16_top_k_runs_widened_and_selects_exactly_as_eager():
    """torch exports TopK on bfloat16, which no ONNX opset it writes (<= 23) allows: the backend widens it to
    float32 (exact) and narrows the values back, so values and indices equal eager's."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)

    def select(x):
        values, indices = torch.topk(x * 2, 5)
        ordered, order = torch.sort(x, dim=-1)
        return values, indices, ordered, order

    backend = gt.backend()
    got = torch.compile(select, backend=backend, fullgraph=True, dynamic=False)(x)
    for a, b in zip(got, select(x)):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")   # dynamo's, not ours
def test_a_refused_backward_falls_back_with_its_gradients_in_place():
    """The backward graph returns None for cos and sin; falling back must run it as AOTAutograd handed it (not the
    copy geir edited for export), or the gradient would land on the wrong input."""
    g = torch.Generator().manual_seed(6)
    inputs = [torch.randn(1, 8, 2, 16, generator=g).requires_grad_(), torch.randn(1, 8, 1, 16, generator=g),
              torch.randn(1, 8, 1, 16, generator=g)]
    backend = gt.backend(target="ascend910b", fallback=True)   # the grad kernel exists on ascend950 only (RP-T1)
    with pytest.warns(geir.GeirWarning, match="backward graph runs eagerly.*RP-T1"):
        _compare(backend, lambda x, c, s: (_RotaryFunction.apply(x, c, s) * 3).sum(), inputs, 1e-6)
    kinds = {r.kind: r for r in backend.reports}
    assert kinds["forward"].fallback is None and kinds["backward"].fallback is not None
