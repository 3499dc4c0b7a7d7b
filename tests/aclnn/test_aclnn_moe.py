"""aclnnMoeTokenUnpermute(Grad): the float64 oracle through strided views, probsOptional null, the statuses, the
data checks at run time, and the device rows the aclnn path has (not the graph path's "no ascend950 kernel")."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir import aclnn
from aclnn.helpers import failure, two_phase
from oracles.moe import unpermute_grad_reference, unpermute_reference

FORWARD = (aclnn.aclnnMoeTokenUnpermuteGetWorkspaceSize, aclnn.aclnnMoeTokenUnpermute)
GRAD = (aclnn.aclnnMoeTokenUnpermuteGradGetWorkspaceSize, aclnn.aclnnMoeTokenUnpermuteGrad)


def _case(tokens=5, topk=2, hidden=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    m = tokens * topk
    permuted = rng.standard_normal((m, hidden)).astype(dtype)
    indices = rng.permutation(m).astype(np.int32)
    probs = rng.random((tokens, topk)).astype(dtype)
    grad = rng.standard_normal((tokens, hidden)).astype(dtype)
    return permuted, indices, probs, grad


def _strided(array):
    """The same values as a non-contiguous view: every other row of a buffer twice as tall."""
    storage = np.zeros((2 * array.shape[0],) + array.shape[1:], array.dtype)
    storage[::2] = array
    strides = [2 * int(np.prod(array.shape[1:]))] + [int(np.prod(array.shape[k + 1:])) for k in
                                                     range(1, array.ndim)]
    return aclnn.aclCreateTensor(storage, shape=list(array.shape), strides=strides), storage


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_forward_reads_strided_inputs_and_matches_the_oracle(runtime, dtype):
    """Doc: the inputs take non-contiguous tensors ("支持非连续")."""
    permuted, indices, probs, _ = _case(dtype=geir.as_dtype(dtype).numpy)
    out = np.zeros((5, 8), permuted.dtype)
    (p, p_storage), (s, _), (w, _) = _strided(permuted), _strided(indices), _strided(probs)
    before = p_storage.copy()
    assert two_phase(*FORWARD, p, s, w, False, None, aclnn.aclCreateTensor(out)) == 0
    want, magnitude = unpermute_reference(permuted, indices, probs)
    np.testing.assert_allclose(out.astype(np.float64), want, atol=float(np.finfo(out.dtype).eps) * 8 * magnitude.max()
                               if dtype != "float32" else 1e-6 * magnitude.max())
    assert np.array_equal(p_storage, before)


def test_grad_equals_geir_run_bit_for_bit_and_the_oracle(runtime):
    permuted, indices, probs, grad = _case(seed=1)
    ptg, pg = np.full((10, 8), np.nan, np.float32), np.full((5, 2), np.nan, np.float32)
    assert two_phase(*GRAD, aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(grad),
                     aclnn.aclCreateTensor(indices), aclnn.aclCreateTensor(probs), False, None,
                     aclnn.aclCreateTensor(ptg), aclnn.aclCreateTensor(pg)) == 0
    b = geir.GraphBuilder("g")
    node = b.MoeTokenUnpermuteGrad(b.input("p", "float32", (10, 8)), b.input("d", "float32", (5, 8)),
                                   b.input("s", "int32", (10,)), b.input("w", "float32", (5, 2)))
    b.output(node[0], "ptg"), b.output(node[1], "pg")
    ran = geir.run(b.build(), {"p": permuted, "d": grad, "s": indices, "w": probs}, runtime=runtime)
    assert np.array_equal(ptg, ran["ptg"]) and np.array_equal(pg, ran["pg"])
    want_ptg, _, want_pg, _ = unpermute_grad_reference(permuted, grad, indices, probs)
    np.testing.assert_allclose(ptg, want_ptg, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pg, want_pg, rtol=1e-5, atol=1e-5)


def test_null_probs_writes_no_probs_grad(runtime):
    permuted, indices, _, _ = _case(tokens=10, topk=1, seed=2)
    grad = np.random.default_rng(2).standard_normal((10, 8)).astype(np.float32)
    ptg, untouched = np.zeros((10, 8), np.float32), np.full((10, 1), 7.0, np.float32)
    assert two_phase(*GRAD, aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(grad),
                     aclnn.aclCreateTensor(indices), None, False, None, aclnn.aclCreateTensor(ptg),
                     aclnn.aclCreateTensor(untouched)) == 0
    assert np.array_equal(ptg[indices], grad) and np.all(untouched == 7.0)


def test_restore_shape_is_accepted_and_ignored(runtime):
    permuted, indices, probs, _ = _case(seed=3)
    a, b = np.zeros((5, 8), np.float32), np.zeros((5, 8), np.float32)
    for out, shape in ((a, None), (b, aclnn.aclCreateIntArray([5, 8]))):
        assert two_phase(*FORWARD, aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(indices),
                         aclnn.aclCreateTensor(probs), False, shape, aclnn.aclCreateTensor(out)) == 0
    assert np.array_equal(a, b)


def test_bad_indices_are_found_at_run_time_and_the_output_is_untouched(runtime):
    """MU-D1 at phase two: ACLNN_ERR_RUNTIME_ERROR naming the position and value; nothing is written."""
    permuted, indices, probs, _ = _case(seed=4)
    indices[3] = indices[7]
    out = np.full((5, 8), 5.0, np.float32)
    status, size, executor = FORWARD[0](aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(indices),
                                        aclnn.aclCreateTensor(probs), False, None, aclnn.aclCreateTensor(out))
    assert status == 0
    assert FORWARD[1](aclnn.aclrtMalloc(size), size, executor, None) == 361001
    failure(361001, "MU-D1", "positions 3 and 7")
    assert np.all(out == 5.0)


def test_statuses_of_the_parameter_checks(runtime):
    permuted, indices, probs, grad = _case(seed=5)
    t = aclnn.aclCreateTensor
    assert two_phase(*FORWARD, None, t(indices), t(probs), False, None, t(np.zeros((5, 8), np.float32))) == 161001
    failure(161001, "permutedTokens")
    assert two_phase(*FORWARD, t(permuted), t(indices), t(probs), False, None, None) == 161001
    failure(161001, "out")
    assert two_phase(*FORWARD, t(permuted), t(indices.astype(np.int64)), t(probs), False, None,
                     t(np.zeros((5, 8), np.float32))) == 161002
    failure(161002, "SCH-5", "sorted_indices")
    assert two_phase(*FORWARD, t(permuted), t(indices), t(probs), False, None,
                     t(np.zeros((5, 8), np.float16))) == 161002
    failure(161002, "out", "data type", "float32")
    assert two_phase(*FORWARD, t(permuted), t(indices), t(probs), False, None,
                     t(np.zeros((4, 8), np.float32))) == 161002
    failure(161002, "out", "shape", "[5, 8]")
    assert two_phase(*FORWARD, t(permuted), t(indices[:9]), t(probs), False, None,
                     t(np.zeros((5, 8), np.float32))) == 561002
    failure(561002, "MU-S2")
    out_view = aclnn.aclCreateTensor(np.zeros((10, 8), np.float32), shape=[5, 8], strides=[16, 1])
    assert two_phase(*FORWARD, t(permuted), t(indices), t(probs), False, None, out_view) == 161002
    failure(161002, "out", "contiguous")


def test_ascend950_has_the_aclnn_path_that_the_graph_path_lacks(runtime, on_device):
    """On ascend950 CANN routes these APIs to MoeFinalizeRoutingV2(Grad): MU-T1/MG-T1 are graph-path rows."""
    permuted, indices, probs, grad = _case(seed=6)
    on_device("ascend950")
    out = np.zeros((5, 8), np.float32)
    assert two_phase(*FORWARD, aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(indices),
                     aclnn.aclCreateTensor(probs), False, None, aclnn.aclCreateTensor(out)) == 0
    want, _ = unpermute_reference(permuted, indices, probs)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert not geir.check(_graph(), "ascend950").ok     # the graph path is refused there


def _graph():
    b = geir.GraphBuilder("g")
    b.output(b.MoeTokenUnpermute(b.input("p", "float32", (10, 8)), b.input("s", "int32", (10,)),
                                 b.input("w", "float32", (5, 2))), "y")
    return b.build()


def test_topk_over_512_is_the_tiling_refusal_on_a2(runtime, on_device):
    """MU-T2 (K <= 512 on Atlas A2/A3) through the API: 561002 naming the rule."""
    on_device("ascend910b")
    tokens, topk = 1, 513
    permuted, indices, probs, _ = _case(tokens=tokens, topk=topk, hidden=2, seed=7)
    assert two_phase(*FORWARD, aclnn.aclCreateTensor(permuted), aclnn.aclCreateTensor(indices),
                     aclnn.aclCreateTensor(probs), False, None,
                     aclnn.aclCreateTensor(np.zeros((tokens, 2), np.float32))) == 561002
    failure(561002, "MU-T2", "513")


def test_every_null_is_found_before_any_data_type(runtime):
    """op_api runs CheckNotNull over all tensors before CheckDtypeValid: a null permutedTokens with an int32
    probsGradOut is 161001 naming the null one (review of issue 27)."""
    grad = aclnn.aclCreateTensor(np.zeros((6, 5), np.float32))
    status = two_phase(*GRAD, None, grad, aclnn.aclCreateTensor(np.arange(6, dtype=np.int32)), None, False, None,
                       aclnn.aclCreateTensor(np.zeros((6, 5), np.float32)),
                       aclnn.aclCreateTensor(np.zeros(6, np.int32)))
    assert status == 161001
    failure(161001, "permutedTokens")
    status = two_phase(*GRAD, grad, grad, aclnn.aclCreateTensor(np.arange(6, dtype=np.int32)), None, False, None,
                       aclnn.aclCreateTensor(np.zeros((6, 5), np.float32)),
                       aclnn.aclCreateTensor(np.zeros(6, np.int32)))
    assert status == 161002
    failure(161002, "probsGradOut", "ACL_INT32")
