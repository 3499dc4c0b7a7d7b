"""geir.torch's sparse attention calls: bits equal to geir.run (float16, bfloat16; BSND, TND; rope; KV merge),
gradcheck through the grad op in float64, torch_npu's absent outputs, compile of a training step, rule ids."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import geir  # noqa: E402
import geir.torch as gt  # noqa: E402
from geir.tools.torch._bridge import to_torch  # noqa: E402

from sparse_attention.helpers import SFA_GRAD, AttentionCase, sfa_graph, sfa_grad_feeds  # noqa: E402
from .helpers import as_numpy, bits  # noqa: E402

_LENGTHS = ("actual_seq_lengths_query", "actual_seq_lengths_kv")


def _tensors(arrays: dict) -> dict:
    return {k: None if v is None else to_torch(np.ascontiguousarray(v).copy()) for k, v in arrays.items()}


def _forward(case: AttentionCase, t: dict, **extra):
    value = t["key"] if case.kv_merge else t["value"]
    lengths = {k: t[k] for k in _LENGTHS} if case.layout == "TND" else {}
    return gt.npu_sparse_flash_attention(
        t["query"], t["key"], value, t["sparse_indices"], case.scale, query_rope=t["query_rope"],
        key_rope=t["key_rope"], sparse_block_size=case.bs, layout_query=case.layout, layout_kv=case.layout,
        sparse_mode=case.mode, **lengths, **extra)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("rope,merge", [(0, False), (4, False), (4, True)], ids=["plain", "rope", "rope-kv-merge"])
def test_forward_and_grad_equal_geir_run_bit_for_bit(dtype, layout, rope, merge):
    case = AttentionCase(layout=layout, dtype=dtype, Dr=rope, kv_merge=merge, N1=4, N2=2, bs=2, seed=3)
    arrays = case.arrays()
    t = _tensors(arrays)
    out, row_max, row_sum = _forward(case, t, return_softmax_lse=True)
    graph, feeds = sfa_graph(arrays, value_is_key=merge, **case.forward_attrs())
    ref = geir.run(graph, feeds)
    for got, name in ((out, "attention_out"), (row_max, "softmax_max"), (row_sum, "softmax_sum")):
        assert np.array_equal(bits(got), bits(ref[name])), name
    d_out = to_torch(np.random.default_rng(1).standard_normal(out.shape).astype(arrays["query"].dtype))
    value = t["key"] if merge else t["value"]
    lengths = [t[k] for k in _LENGTHS] if layout == "TND" else [None, None]
    grads = gt.npu_sparse_flash_attention_grad(t["query"], t["key"], value, t["sparse_indices"], d_out, out, row_max,
                                               row_sum, case.scale, case.bs, t["query_rope"], t["key_rope"], *lengths,
                                               layout, case.mode)
    grad_graph, grad_feeds = sfa_graph(sfa_grad_feeds(arrays, ref, as_numpy(d_out), layout), op=SFA_GRAD,
                                       value_is_key=merge, **case.grad_attrs())
    grad_ref = geir.run(grad_graph, grad_feeds)
    names = ["d_query", "d_key", "d_value", "d_query_rope", "d_key_rope"][:5 if rope else 3]
    assert sorted(grad_ref) == sorted(names)   # KV merge: the graph feeds key as value too, as the call does
    for got, name in zip(grads, names):
        assert np.array_equal(bits(got), bits(grad_ref[name])), name
    if not rope:
        assert grads[3].shape == (0,) and grads[4].shape == (0,) and grads[3].dtype == out.dtype
    leaves = {k: t[k].clone().requires_grad_() for k in ("query", "key", "value", "query_rope", "key_rope")
              if t[k] is not None}
    again = _forward(case, {**t, **leaves}, return_softmax_lse=True)
    again[0].backward(d_out)
    assert torch.equal(leaves["query"].grad, grads[0])
    if merge:
        assert torch.equal(leaves["key"].grad, grads[1] + grads[2])
    else:
        assert torch.equal(leaves["key"].grad, grads[1]) and torch.equal(leaves["value"].grad, grads[2])
    if rope:
        assert torch.equal(leaves["query_rope"].grad, grads[3]) and torch.equal(leaves["key_rope"].grad, grads[4])


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_gradcheck_in_float64_through_the_grad_op(layout):
    case = AttentionCase(layout=layout, dtype="float64", B=1, S1=3, S2=5, N1=2, N2=1, D=4, D2=4, Dr=2, K=3,
                         full=True, tnd_q=[2, 3], tnd_kv=[3, 5], seed=4)
    t = _tensors(case.arrays())
    lengths = {k: t[k] for k in _LENGTHS} if layout == "TND" else {}

    def attention(query, key, value, query_rope, key_rope):
        return gt.npu_sparse_flash_attention(query, key, value, t["sparse_indices"], case.scale, query_rope=query_rope,
                                             key_rope=key_rope, layout_query=layout, layout_kv=layout,
                                             return_softmax_lse=True, **lengths)[0]

    inputs = tuple(t[k].requires_grad_() for k in ("query", "key", "value", "query_rope", "key_rope"))
    assert torch.autograd.gradcheck(attention, inputs)


def test_absent_statistics_are_what_torch_npu_returns_and_training_needs_them():
    case = AttentionCase(dtype="bfloat16")
    t = _tensors(case.arrays())
    query = t["query"].requires_grad_()
    out, row_max, row_sum = _forward(case, {**t, "query": query})
    assert row_max.shape == (0,) and row_sum.shape == (0,) and row_max.dtype == torch.float32
    with pytest.raises(RuntimeError, match="return_softmax_lse=True"):
        out.sum().backward()
    with pytest.raises(geir.GraphError, match="return_softmax_lse=True"):
        gt.npu_sparse_flash_attention_grad(t["query"], t["key"], t["value"], t["sparse_indices"], out.detach(),
                                           out.detach(), row_max, row_sum, case.scale, 1)


def test_compile_fullgraph_runs_a_training_step_as_eager():
    case = AttentionCase(layout="BSND", dtype="float64", Dr=2, full=True, seed=5)
    t = _tensors(case.arrays())

    def step(query, key, value, query_rope, key_rope):
        out, _, _ = gt.npu_sparse_flash_attention(query, key, value, t["sparse_indices"], case.scale,
                                                  query_rope=query_rope, key_rope=key_rope, return_softmax_lse=True)
        return (out * out).sum()

    names = ("query", "key", "value", "query_rope", "key_rope")
    eager = [t[k].clone().requires_grad_() for k in names]
    compiled = [t[k].clone().requires_grad_() for k in names]
    expected = step(*eager)
    expected.backward()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled)
    got.backward()
    assert torch.equal(got, expected) and all(torch.equal(a.grad, b.grad) for a, b in zip(compiled, eager))


def test_fake_tensors_give_the_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = AttentionCase(layout="TND", dtype="float16", N1=4, N2=2, Dr=4)
    t = _tensors(case.arrays())
    real = _forward(case, t, return_softmax_lse=True)
    with FakeTensorMode() as mode:
        fake = _forward(case, {k: None if v is None else mode.from_tensor(v) for k, v in t.items()},
                        return_softmax_lse=True)
        assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]


def test_rule_ids_reach_the_caller():
    case = AttentionCase(layout="BSND", dtype="float16", full=True, K=3, seed=6)
    t = _tensors(case.arrays())
    repeated = t["sparse_indices"].clone()
    repeated[0, -1, 0, :2] = 0                 # one block id twice in a row the op reads
    with pytest.raises(geir.ExecutionError) as data:
        _forward(case, {**t, "sparse_indices": repeated})
    assert data.value.rule == "SA-D3"
    with pytest.raises(geir.GraphError) as shape:
        _forward(case, {**t, "query": t["query"][..., :-1]})
    assert shape.value.rule is not None and shape.value.location.filename == __file__


def test_the_registrations_pass_torch_opcheck():
    case = AttentionCase(layout="TND", dtype="float64", Dr=2, full=True, seed=7)
    t = _tensors(case.arrays())
    args = (t["query"].requires_grad_(), t["key"].requires_grad_(), t["value"].requires_grad_(), t["sparse_indices"],
            case.scale, None, t["actual_seq_lengths_query"], t["actual_seq_lengths_kv"], t["query_rope"],
            t["key_rope"], 1, "TND", "TND", 3, 2**63 - 1, 2**63 - 1, 0, True, None)
    torch.library.opcheck(torch.ops.geir.sparse_flash_attention.default, args)
    with gt.npu_shim() as torch_npu:
        assert torch_npu.npu_sparse_flash_attention is gt.npu_sparse_flash_attention
        assert torch_npu.npu_sparse_flash_attention_grad is gt.npu_sparse_flash_attention_grad
