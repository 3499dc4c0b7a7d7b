"""geir.torch's MoE calls: gradients (gradcheck, float64), bits equal to geir.run, rule ids, inputs untouched."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import geir  # noqa: E402
import geir.torch as gt  # noqa: E402

from .helpers import DTYPES, bits, run_op  # noqa: E402

T, K, H, E = 6, 3, 16, 4


def _routing(seed: int = 0, dtype: torch.dtype = torch.float32, tokens: int = T, topk: int = K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(tokens)]).to(torch.int32)
    probs = torch.rand(tokens, topk, generator=g).to(dtype)
    return x, ids, probs


def test_permute_then_unpermute_is_differentiable_in_float64_with_and_without_probs():
    x, ids, probs = _routing()
    x64, p64 = x.double().requires_grad_(), probs.double().requires_grad_()

    def step(tokens, weights):
        permuted, slots = gt.npu_moe_token_permute(tokens, ids)
        return gt.npu_moe_token_unpermute(permuted * 1.5, slots, weights)

    assert torch.autograd.gradcheck(step, (x64, p64))
    assert torch.autograd.gradcheck(lambda t: gt.npu_moe_token_unpermute(gt.npu_moe_token_permute(t, ids[:, 0])[0],
                                                                         gt.npu_moe_token_permute(t, ids[:, 0])[1]),
                                    (x64,))


def test_unpermute_alone_and_dropped_rows_are_differentiable():
    x, ids, probs = _routing(1)
    permuted, slots = gt.npu_moe_token_permute(x, ids, num_out_tokens=T * K - 4)   # the last 4 rows dropped
    assert permuted.shape == (T * K - 4, H)
    rows, p64 = permuted.double().requires_grad_(), probs.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda r, p: gt.npu_moe_token_unpermute(r, slots, p), (rows, p64))
    assert torch.autograd.gradcheck(lambda t: gt.npu_moe_token_permute(t, ids, num_out_tokens=-4)[0],
                                    (x.double().requires_grad_(),))


def test_the_unpermute_backward_goes_through_grad_v2():
    x, ids, probs = _routing(2)
    permuted, slots = gt.npu_moe_token_permute(x, ids)
    rows, weights = permuted.clone().requires_grad_(), probs.clone().requires_grad_()
    out = gt.npu_moe_token_unpermute(rows, slots, weights)
    dy = torch.randn_like(out)
    out.backward(dy)
    expected = gt.npu_moe_token_unpermute_grad_v2(dy, slots, rows.shape[0], rows.dtype, probs, False, None, permuted)
    assert torch.equal(rows.grad, expected[0]) and torch.equal(weights.grad, expected[1])
    same = gt.npu_moe_token_unpermute_grad(permuted, dy, slots, probs)
    assert torch.equal(same[0], expected[0]) and torch.equal(same[1], expected[1])
    unweighted = torch.randn(T * K, H)      # without probs every slot is a token of its own (topK 1)
    none = gt.npu_moe_token_unpermute_grad_v2(unweighted, slots, rows.shape[0], rows.dtype)
    assert none[1].dim() == 0 and torch.equal(none[0][slots.long()], unweighted)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("probs_dtype", DTYPES, ids=str)
def test_unpermute_and_its_grad_equal_geir_run_bit_for_bit(dtype, probs_dtype):
    x, ids, probs = _routing(3, dtype)
    probs = probs.to(probs_dtype)
    permuted, slots = gt.npu_moe_token_permute(x, ids)
    ref_rows, ref_slots = run_op("MoeTokenPermute", {"tokens": x, "indices": ids})
    assert np.array_equal(bits(permuted), bits(ref_rows)) and np.array_equal(slots.numpy(), ref_slots)
    out = gt.npu_moe_token_unpermute(permuted, slots, probs)
    (ref,) = run_op("MoeTokenUnpermute", {"permuted_tokens": permuted, "sorted_indices": slots, "probs": probs})
    assert out.dtype == dtype and np.array_equal(bits(out), bits(ref))
    dy = torch.randn(T, H).to(dtype)
    grads = gt.npu_moe_token_unpermute_grad(permuted, dy, slots, probs)
    refs = run_op("MoeTokenUnpermuteGrad", {"permuted_tokens": permuted, "unpermuted_tokens_grad": dy,
                                            "sorted_indices": slots, "probs": probs})
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(grads, refs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_permute_grad_equals_geir_run_bit_for_bit(dtype):
    x, ids, _ = _routing(4, dtype)
    permuted, slots = gt.npu_moe_token_permute(x, ids)
    dy = torch.randn(permuted.shape).to(dtype)
    got = gt.npu_moe_token_permute_grad_v2(dy, slots, T, dtype, K)
    (ref,) = run_op("MoeTokenPermuteGrad", {"permuted_output_grad": dy, "sorted_indices": slots}, num_topk=K)
    assert got.dtype == dtype and np.array_equal(bits(got), bits(ref))
    tokens = x.clone().requires_grad_()
    gt.npu_moe_token_permute(tokens, ids)[0].backward(dy)
    assert torch.equal(tokens.grad, got)


def test_inputs_are_never_modified():
    x, ids, probs = _routing(5)
    permuted, slots = gt.npu_moe_token_permute(x, ids)
    dy = torch.randn(T, H)
    before = [t.clone() for t in (x, ids, probs, permuted, slots, dy)]
    gt.npu_moe_token_unpermute(permuted, slots, probs)
    gt.npu_moe_token_unpermute_grad(permuted, dy, slots, probs)
    gt.npu_moe_token_unpermute_grad_v2(dy, slots, T * K, torch.float32, probs, False, None, permuted)
    gt.npu_moe_token_permute(x, ids)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, ids, probs, permuted, slots, dy)))


def test_rule_ids_reach_the_caller():
    x, ids, probs = _routing(6)
    permuted, slots = gt.npu_moe_token_permute(x, ids)
    repeated = slots.clone()
    repeated[1] = repeated[0]
    with pytest.raises(geir.ExecutionError) as data:
        gt.npu_moe_token_unpermute(permuted, repeated, probs)
    assert data.value.rule == "MU-D1" and "MU-D1" in str(data.value)
    with pytest.raises(geir.GraphError) as shape:
        gt.npu_moe_token_unpermute(permuted, slots[:-1], probs)
    assert shape.value.rule == "MU-S2"
    assert shape.value.location is not None and shape.value.location.filename == __file__   # the caller's line
    with pytest.raises(geir.GraphError) as padded:
        gt.npu_moe_token_permute(x, ids, padded_mode=True)
    assert padded.value.rule == "MP-S3"
    bad = ids.clone()
    bad[2, 1] = -3
    with pytest.raises(geir.ExecutionError) as expert:
        gt.npu_moe_token_permute(x, bad)
    assert expert.value.rule == "MP-D1"
    with pytest.raises(geir.GraphError) as missing:
        gt.npu_moe_token_unpermute_grad_v2(torch.randn(T, H), slots, T * K, torch.float32, probs)
    assert missing.value.rule == "MG-S4"
    with pytest.raises(geir.GraphError) as dtype:
        gt.npu_moe_token_unpermute(permuted, slots.long(), probs)
    assert dtype.value.rule is not None


def test_a_tensor_off_the_cpu_is_a_clear_error():
    from geir.tools.torch._bridge import to_numpy

    with pytest.raises(geir.ExecutionError, match="CPU only"):
        to_numpy(torch.empty(2, 2, device="meta"), "permuted_tokens")


@pytest.mark.parametrize("path", ["public", "op"])
def test_a_negative_row_count_is_refused_not_read_as_a_slice(path):
    x, ids, probs = _routing(7)
    permuted, slots = gt.npu_moe_token_permute(x, ids)
    grad = torch.randn(T, H)
    call = gt.npu_moe_token_unpermute_grad_v2 if path == "public" else gt.npu_moe_token_unpermute_grad_v2.op
    for rows, weights in ((-1, None), (-T * K, None), (-1, probs)):
        with pytest.raises(geir.GraphError) as refused:
            call(grad, slots, rows, torch.float32, weights)
        assert refused.value.rule == "MG-S3" and f"[0, {T * K}]" in str(refused.value) and f"got {rows}" in str(
            refused.value)


def test_a_wrong_rank_with_dropped_rows_is_reported_with_the_callers_shape():
    x, ids, probs = _routing(9)
    permuted, slots = gt.npu_moe_token_permute(x, ids)
    rows = T * K - 4                                    # rows dropped: a 2-D permuted_tokens would be padded
    with pytest.raises(geir.GraphError) as refused:
        gt.npu_moe_token_unpermute_grad_v2(torch.randn(T, H), slots, rows, torch.float32, probs, False, None,
                                           torch.randn(rows, 2, H // 2))
    assert refused.value.rule == "MG-S3" and f"[{rows},2,{H // 2}]" in str(refused.value)
