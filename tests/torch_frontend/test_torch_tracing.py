"""geir.torch under FakeTensor tracing and torch.compile(fullgraph=True), the op registrations (opcheck), and
``import geir`` without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import geir.torch as gt  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

T, K, H, E = 8, 2, 16, 4


def _moe_step(tokens, ids, probs, weight):
    permuted, slots = gt.npu_moe_token_permute(tokens, ids)
    expert = permuted @ weight
    return gt.npu_moe_token_unpermute(expert, slots, probs)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    return (torch.randn(T, H, generator=g, dtype=dtype), ids, torch.rand(T, K, generator=g, dtype=dtype),
            torch.randn(H, H, generator=g, dtype=dtype))


def test_fake_tensors_trace_a_moe_step_with_the_shapes_the_kernels_give():
    real = _moe_step(*_inputs())
    with FakeTensorMode() as mode:
        fake = _moe_step(*(mode.from_tensor(t) for t in _inputs()))
        assert fake.shape == real.shape and fake.dtype == real.dtype
        grad = gt.npu_moe_token_unpermute_grad_v2(fake, mode.from_tensor(torch.arange(T * K, dtype=torch.int32)),
                                                  T * K, torch.float32)
        assert grad[0].shape == (T * K, H) and grad[1].dim() == 0


def test_compile_fullgraph_runs_forward_and_backward_as_eager():
    tokens, ids, probs, weight = _inputs(torch.float64)
    leaves = [t.clone().requires_grad_() for t in (tokens, probs, weight)]
    compiled = torch.compile(_moe_step, fullgraph=True, backend="aot_eager")
    out = compiled(leaves[0], ids, leaves[1], leaves[2])
    out.sum().backward()
    eager = [t.clone().requires_grad_() for t in (tokens, probs, weight)]
    expected = _moe_step(eager[0], ids, eager[1], eager[2])
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, eager))


def test_compile_fullgraph_keeps_the_in_place_rotary():
    cos, sin = torch.rand(1, 4, 1, 8).cos(), torch.rand(1, 4, 1, 8).sin()

    def rope(q):
        q = q * 2
        gt.inplace_partial_rotary_mul(q, cos, sin, partial_slice=[8, 16])
        return q

    q = torch.randn(2, 4, 3, 16)
    assert torch.equal(torch.compile(rope, fullgraph=True, backend="aot_eager")(q), rope(q))


@pytest.mark.parametrize("name", ["npu_moe_token_unpermute", "npu_moe_token_permute", "partial_rotary_mul"])
def test_the_registrations_pass_torch_opcheck(name):
    tokens, ids, probs, _ = _inputs(torch.float64)
    permuted, slots = gt.npu_moe_token_permute(tokens, ids)
    args = {"npu_moe_token_unpermute": (permuted.requires_grad_(), slots, probs.requires_grad_()),
            "npu_moe_token_permute": (tokens.requires_grad_(), ids),
            "partial_rotary_mul": (torch.randn(2, 4, 3, 16, dtype=torch.float64, requires_grad=True),
                                   torch.rand(1, 4, 1, 8, dtype=torch.float64),
                                   torch.rand(1, 4, 1, 8, dtype=torch.float64))}[name]
    kwargs = {"partial_slice": [8, 16]} if name == "partial_rotary_mul" else {}
    torch.library.opcheck(getattr(torch.ops.geir, name).default, args, kwargs)


@pytest.mark.parametrize("name", ["inplace_partial_rotary_mul", "inplace_partial_rotary_mul_backward"])
def test_the_in_place_ops_pass_opcheck_with_geirs_own_autograd_kernel(name):
    """Their Autograd kernel is rotary.py's (it refuses tensors autograd would record), not custom_op's; opcheck
    (schema, fake kernel, dispatch) passes on inputs that need no gradient."""
    op = getattr(torch.ops.geir, name).default
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd")
    assert "rotary.py" in torch._C._dispatch_dump(op.name()).split("Autograd[alias]")[1].splitlines()[0]
    args = (torch.randn(2, 4, 3, 16, dtype=torch.float64), torch.rand(1, 4, 1, 8, dtype=torch.float64),
            torch.rand(1, 4, 1, 8, dtype=torch.float64))
    torch.library.opcheck(op, args, {"partial_slice": [8, 16]})


def test_import_geir_does_not_import_torch():
    code = ("import sys, geir; assert 'torch' not in sys.modules, 'torch imported'; import geir.torch; "
            "assert geir.torch is sys.modules['geir.tools.torch'] and 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
