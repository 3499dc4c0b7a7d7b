"""The native SparseFlashAttention(Grad) kernels: they run (not the bodies), agree with the NumPy runtime
on every layout, mode, block size, head grouping, rope, sinks, KV merge and paged cache, give the same
bits whatever the thread count, key split or chunking, and enforce the data rules themselves."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import geir
from native_helpers import native_calls, requires_compiler, run_isolated
from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase, paged_arrays, sfa_grad_feeds, sfa_graph

pytestmark = requires_compiler

BOUND = {"float16": 1e-3, "bfloat16": 4e-3}
"""Relative Frobenius distance to the NumPy runtime: both compute in float32 and round at the same points, so
only summation order and exp's last bits differ (an output element may land one input-dtype ulp apart); the
spec's bound against the float64 oracle is 5e-3 / 2e-2."""

CASES = {
    "bsnd_f16_mode3_rope": AttentionCase(B=2, S1=6, S2=16, N1=4, D=16, D2=16, Dr=8, K=6),
    "bsnd_bf16_mode0_bs3_gqa": AttentionCase(B=2, S1=5, S2=17, N1=6, N2=2, D=24, D2=16, K=4, bs=3, mode=0,
                                             dtype="bfloat16", seed=1),
    "tnd_f16_mode3_bs2_rope": AttentionCase(layout="TND", N1=4, D=16, D2=16, Dr=8, K=4, bs=2, tnd_q=[3, 7, 7, 12],
                                            tnd_kv=[5, 5, 14, 20], seed=2),
    "tnd_bf16_mode0_n2": AttentionCase(layout="TND", N1=4, N2=2, D=20, D2=12, K=5, mode=0, dtype="bfloat16", seed=3),
    "bsnd_f16_one_head_per_group": AttentionCase(B=1, S1=9, S2=30, N1=3, N2=3, D=12, D2=12, Dr=4, K=7, mode=0, seed=4),
    "bsnd_bf16_kv_merge": AttentionCase(B=2, S1=8, S2=24, N1=12, D=40, D2=32, K=6, bs=2, kv_merge=True,
                                        dtype="bfloat16", seed=5),
    "bsnd_bf16_block_size_int64_max": AttentionCase(B=1, S1=4, S2=8, N1=2, D=8, D2=8, K=2, bs=2 ** 63 - 1,
                                                    dtype="bfloat16", seed=10),
    "bsnd_f16_long_rows": AttentionCase(B=1, S1=16, S2=512, N1=8, D=320, D2=264, Dr=16, K=300, mode=0, full=True,
                                        seed=6),
    # key tensors far larger than the keys read (> 2^16 rows): the plan sorts the entries instead of mapping every
    # key row (its memory follows the keys read); two radix passes, and the grad's outputs walk the sorted rows
    "bsnd_bf16_long_kv_read_sparsely": AttentionCase(B=2, S1=4, S2=40000, N1=4, N2=2, D=8, D2=8, K=4, bs=2, mode=0,
                                                     full=True, dtype="bfloat16", seed=11),
    "tnd_f16_long_kv_read_sparsely": AttentionCase(layout="TND", N1=2, D=8, D2=4, Dr=4, K=3, bs=4, tnd_q=[3, 7],
                                                   tnd_kv=[30000, 70000], full=True, seed=12),
}
FORWARD_ONLY = {
    "bsnd_f16_sinks_lengths": AttentionCase(B=3, S1=6, S2=12, N1=6, N2=3, D=16, D2=8, K=4, bs=2, sinks=True,
                                            lengths=True, mode=0, seed=7),
    "bsnd_bf16_sinks_mode3": AttentionCase(B=2, S1=6, S2=10, N1=4, D=16, D2=16, Dr=8, K=5, sinks=True, lengths=True,
                                           dtype="bfloat16", seed=8),
}


def _assert_agrees(got: dict, want: dict, dtype: str) -> None:
    assert set(got) == set(want)
    for name in want:
        a, b = got[name].astype(np.float64), want[name].astype(np.float64)
        assert a.shape == b.shape, name
        distance = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert distance <= BOUND[dtype], (name, distance)
        if a.ndim:   # rows the op never writes (unselected keys, rows without keys) are exact zeros here too
            structural = (b == 0).all(axis=-1)   # (a row may also cancel to 0 here and to noise there: allowed)
            assert (a[structural] == 0).all(), name


def _forward(case: AttentionCase, arrays: dict | None = None):
    arrays = case.arrays() if arrays is None else arrays
    if case.kv_merge:
        arrays = dict(arrays, value=np.ascontiguousarray(arrays["key"][..., :case.D2]))
    return sfa_graph(arrays, SFA, **case.forward_attrs())


def _grad(case: AttentionCase):
    arrays = case.arrays()
    graph, feeds = _forward(case, arrays)
    out = geir.run(graph, feeds)
    d_out = np.random.default_rng(case.seed + 50).standard_normal(out["attention_out"].shape)
    grad = sfa_grad_feeds(arrays, out, d_out.astype(arrays["query"].dtype), case.layout)
    return sfa_graph(grad, SFA_GRAD, **case.grad_attrs())


def _native_run(graph, feeds) -> dict:
    before = native_calls()
    result = geir.run(graph, feeds, runtime="onnxruntime")
    assert native_calls() == before + 1, "the native kernel did not run"
    return result


@pytest.mark.parametrize("name", [*CASES, *FORWARD_ONLY])
def test_native_forward_agrees_with_numpy(name):
    case = {**CASES, **FORWARD_ONLY}[name]
    graph, feeds = _forward(case)
    _assert_agrees(_native_run(graph, feeds), geir.run(graph, feeds), case.dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_native_grad_agrees_with_numpy(name):
    case = CASES[name]
    graph, feeds = _grad(case)
    _assert_agrees(_native_run(graph, feeds), geir.run(graph, feeds), case.dtype)


@pytest.mark.parametrize("spare_pages", [3, 5000])
@pytest.mark.parametrize("layout, dtype", [("BSND", "float16"), ("TND", "bfloat16")])
def test_native_paged_forward_agrees_with_the_dense_forward(layout, dtype, spare_pages):
    """Paged KV (spec 4.11): the native kernel on the paged cache equals the NumPy runtime on the dense keys, also
    when the cache holds far more pages than the call reads (5000 spare: the plan sorts the keys it reads)."""
    case = AttentionCase(layout=layout, B=2, S1=5, S2=40, N1=4, D=16, D2=16, Dr=8, K=5, bs=2, dtype=dtype, seed=9,
                         tnd_q=[4, 9], tnd_kv=[19, 40])
    arrays = case.arrays()
    dense, dense_feeds = _forward(case, arrays)
    paged = paged_arrays(arrays, layout, 16, np.random.default_rng(3), spare_pages=spare_pages)
    attrs = dict(case.forward_attrs(), layout_kv="PA_BSND", return_softmax_lse=False)
    graph, feeds = sfa_graph(paged, SFA, **attrs)
    got = _native_run(graph, feeds)
    want = geir.run(dense, dense_feeds)
    _assert_agrees({"attention_out": got["attention_out"]}, {"attention_out": want["attention_out"]}, dtype)


DETERMINISM = """
    import ctypes, sys, numpy as np, geir
    sys.path[:0] = ["tests"]
    from geir.runtimes.onnxruntime import native_library
    from sparse_attention.test_sfa_grad_determinism import UT_CASES, _grad_problem
    problems = [_grad_problem(UT_CASES[name]) for name in ("bsnd_rope_bf16", "tnd_f16", "kv_merge_bf16")]
    lib = ctypes.CDLL(native_library())
    lib.geir_sfa_key_tasks.argtypes = lib.geir_sfa_chunk_pairs.argtypes = [ctypes.c_long]
    for tasks, chunk in ((0, 0), (1, 0), (3, 5), (7, 1), (64, 2)):
        lib.geir_sfa_key_tasks(tasks)
        lib.geir_sfa_chunk_pairs(chunk)
        bits = []
        for graph, feeds in problems:
            result = geir.run(graph, feeds, runtime="onnxruntime")
            bits += [result[k].view(np.uint16).tobytes().hex() for k in sorted(result)]
        print(tasks, chunk, "|".join(bits))
"""


def test_grad_bits_do_not_depend_on_threads_key_split_or_chunks():
    """CANN's grad UT shapes with every row selecting the same two blocks (duplicate targets everywhere; BSND
    with rope, TND, KV merge): the same bits with 1 and 2 threads, 1 to 64 key tasks, pair chunks of 1, 2, 5 or
    all."""
    runs = []
    for threads in ("1", "2"):
        result = run_isolated(DETERMINISM, env={"GEIR_NUM_THREADS": threads}, timeout=240)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.strip().splitlines()
        assert len(lines) == 5
        runs += [line.split(" ", 2)[2] for line in lines]
    assert len(set(runs)) == 1


@pytest.mark.parametrize("indices, lengths, message", [
    ([[0, 9]], None, "[SA-D3] sparse_indices row (b=0, s1=1, n2=0) entry 1: expected -1 or a block id in [0, NB_b) "
                     "(NB_b = 4), got 9"),
    ([[-1, 1]], None, "[SA-D3] sparse_indices row (b=0, s1=1, n2=0) entry 1: expected -1 (padding only after the "
                      "last valid block id) (NB_b = 4), got 1"),
    ([[2, 2]], None, "[SA-D3] sparse_indices row (b=0, s1=1, n2=0) entry 1: expected a block id not listed before "
                     "(NB_b = 4), got 2"),
    ([[0, 1]], [2, 1], "[SA-D1] actual_seq_lengths_query position 1: expected a non-decreasing value (>= 2), got 1"),
])
def test_the_kernel_itself_enforces_the_data_rules(indices, lengths, message):
    """A model that bypasses geir's own checks: the kernel refuses bad block ids and lengths, the process lives."""
    tnd = lengths is not None
    q_shape, k_shape = ((2, 2, 8), (4, 1, 8)) if tnd else ((1, 2, 2, 8), (1, 4, 1, 8))
    rows = np.array([[0, -1]] + indices, np.int32).reshape(q_shape[:-2] + (1, 2))
    inputs = {"query": np.zeros(q_shape, np.float16), "key": np.zeros(k_shape, np.float16),
              "value": np.zeros(k_shape, np.float16), "sparse_indices": rows}
    attrs = {"scale_value": 0.5, "sparse_mode": 0}
    if tnd:
        attrs.update(layout_query="TND", layout_kv="TND")
        inputs["block_table"] = None
        inputs["actual_seq_lengths_query"] = np.array(lengths, np.int32)
        inputs["actual_seq_lengths_kv"] = np.array([4, 4], np.int32)
    names = [k if v is not None else "" for k, v in inputs.items()]
    feeds = {k: v for k, v in inputs.items() if v is not None}
    script = f"""
        import numpy as np, onnxruntime as ort, pickle, sys
        from onnx import TensorProto as T, helper
        from geir.runtimes.onnxruntime import native_library
        feeds = pickle.loads({pickle.dumps(feeds)!r})
        names = {names!r}
        kinds = {{"float16": T.FLOAT16, "int32": T.INT32}}
        node = helper.make_node("SparseFlashAttention", names, ["out", "mx", "sm"], domain="ai.cann", **{attrs!r})
        graph = helper.make_graph([node], "raw",
            [helper.make_tensor_value_info(k, kinds[str(v.dtype)], v.shape) for k, v in feeds.items()],
            [helper.make_tensor_value_info("out", T.FLOAT16, {list(q_shape)!r}),
             helper.make_tensor_value_info("mx", T.FLOAT, [0]), helper.make_tensor_value_info("sm", T.FLOAT, [0])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.cann", 1)])
        options = ort.SessionOptions()
        options.register_custom_ops_library(native_library())
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        try:
            session.run(None, feeds)
            print("no error")
        except Exception as exc:
            print("raised:", exc)
        print("alive")
    """
    result = run_isolated(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "alive"
    assert f"SparseFlashAttention (geir native kernel): {message}" in result.stdout, result.stdout
