"""Paged KV cache for SparseFlashAttention (layout_kv PA_BSND, spec 4.11): the math equals the dense
forward bit for bit on the NumPy runtime, the ONNX body agrees, and every PA rule is enforced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import geir
from geir.schemas.sparse_attention.paging import gather_dense, paged_keys
from oracles.numerics import bits_equal
from oracles.onnx_runners import run_onnxruntime
from sparse_attention.helpers import AttentionCase, paged_arrays

SFA = "SparseFlashAttention"


def _graph(feeds: dict, **attrs) -> geir.Graph:
    b = geir.GraphBuilder("pa")
    inputs = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items() if v is not None}
    results = b.SparseFlashAttention(**inputs, **attrs)
    b.output(results[0], "attention_out")
    return b.build()


def _attrs(case: AttentionCase, **extra) -> dict:
    attrs = dict(case.forward_attrs(), return_softmax_lse=False)
    attrs.update(extra)
    return attrs


def _feeds(arrays: dict) -> dict:
    return {k: v for k, v in arrays.items() if v is not None}


CASES = [AttentionCase(layout=layout, mode=mode, bs=bs, S1=5, S2=40, K=6, N1=4, N2=n2, D=16, D2=16, Dr=dr, tnd_kv=[20,
                       40], tnd_q=[3, 5], lengths=layout == "BSND", dtype=dtype, seed=seed)
         for layout, mode, bs, n2, dr, dtype, seed in [
             ("BSND", 3, 1, 1, 8, "float16", 0), ("BSND", 0, 2, 1, 0, "bfloat16", 1), ("BSND", 3, 4, 2, 8, "float16", 2),
             ("TND", 3, 1, 1, 8, "bfloat16", 3), ("TND", 0, 2, 2, 0, "float16", 4), ("TND", 3, 16, 1, 8, "float16", 5)]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.layout}-mode{c.mode}-bs{c.bs}-n2{c.N2}-dr{c.Dr}-{c.dtype}")
def test_a_paged_cache_gives_the_dense_result_bit_for_bit(case):
    dense = case.arrays()
    paged = paged_arrays(dense, case.layout, 16, np.random.default_rng(case.seed))
    assert (paged["block_table"] == -1).any()                  # -1 padding in unused table columns
    want = geir.run(_graph(dense, **_attrs(case)), _feeds(dense))["attention_out"]
    graph = _graph(paged, **_attrs(case, layout_kv="PA_BSND"))
    got = geir.run(graph, _feeds(paged))["attention_out"]
    assert bits_equal(got, want)
    on_ort = geir.run(graph, _feeds(paged), runtime="onnxruntime")["attention_out"]
    geir.testing.assert_close(on_ort, got, standard="precision_standard", name="onnxruntime vs numpy")
    on_bodies = run_onnxruntime(geir.to_onnx(graph), _feeds(paged))["attention_out"]   # no native library
    geir.testing.assert_close(on_bodies, got, standard="precision_standard", name="function body vs numpy")


def test_the_statement_of_the_addressing_and_the_body_agree():
    """paged_keys maps the logical keys to their homes; a probe (one-hot values) reads the body's addressing back."""
    case = AttentionCase(layout="TND", mode=0, bs=1, K=8, N1=2, D=16, D2=16, tnd_kv=[5, 9], tnd_q=[2, 4],
                         dtype="float16", full=True, seed=7)
    dense = case.arrays()
    paged = paged_arrays(dense, "TND", 16, np.random.default_rng(1))
    keys = paged_keys("TND", paged["block_table"], paged["actual_seq_lengths_kv"], 16, paged["key"].shape[0])
    np.testing.assert_array_equal(gather_dense(paged["key"], keys), dense["key"][:9])
    np.testing.assert_array_equal(keys.lengths_kv, [5, 9])


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_value_from_the_keys_prefix_matches_cann_golden_convention(layout):
    """CANN's golden and 950 kernel take V = key[..., :D2]; with value given as that prefix both agree."""
    case = AttentionCase(layout=layout, mode=3, D=16, D2=8, S2=32, tnd_kv=[16, 32], lengths=layout == "BSND", seed=9)
    dense = case.arrays()
    dense["value"] = np.ascontiguousarray(dense["key"][..., :8])
    paged = paged_arrays(dense, layout, 16, np.random.default_rng(2))
    paged["value"] = np.ascontiguousarray(paged["key"][..., :8])
    want = geir.run(_graph(dense, **_attrs(case)), _feeds(dense))["attention_out"]
    got = geir.run(_graph(paged, **_attrs(case, layout_kv="PA_BSND")), _feeds(paged))["attention_out"]
    assert bits_equal(got, want)


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_cann_parameter_sets_scaled_down(runtime):
    """pa_bsnd (BSND fp16, B=2, mode 3, bs 1, table (2, 4), aq [18, 93] -> scaled) and tnd_pa_multi_batch
    (TND bf16, B=4, aq [2, 6, 11, 15], akv equal per batch, a table of two ids then -1s)."""
    bsnd = AttentionCase(layout="BSND", B=2, S1=12, S2=64, N1=8, D=32, D2=32, Dr=16, K=32, bs=1, mode=3, full=True,
                         seed=11)
    dense = bsnd.arrays()
    dense["actual_seq_lengths_query"] = np.array([3, 12], np.int32)
    dense["actual_seq_lengths_kv"] = np.array([64, 64], np.int32)
    paged = paged_arrays(dense, "BSND", 16, np.random.default_rng(3))
    assert paged["block_table"].shape == (2, 5)
    want = geir.run(_graph(dense, **_attrs(bsnd)), _feeds(dense))["attention_out"]
    got = geir.run(_graph(paged, **_attrs(bsnd, layout_kv="PA_BSND")), _feeds(paged), runtime=runtime)["attention_out"]
    geir.testing.assert_close(got, want, standard="precision_standard", name="pa_bsnd")
    tnd = AttentionCase(layout="TND", N1=8, D=32, D2=32, Dr=16, K=8, bs=1, mode=3, tnd_q=[2, 6, 11, 15],
                        tnd_kv=[32, 64, 96, 128], dtype="bfloat16", full=True, seed=12)
    dense = tnd.arrays()
    paged = paged_arrays(dense, "TND", 16, np.random.default_rng(4))
    assert (paged["block_table"][:, :2] >= 0).all() and (paged["block_table"][:, 2:] == -1).all()
    want = geir.run(_graph(dense, **_attrs(tnd)), _feeds(dense))["attention_out"]
    got = geir.run(_graph(paged, **_attrs(tnd, layout_kv="PA_BSND")), _feeds(paged), runtime=runtime)["attention_out"]
    geir.testing.assert_close(got, want, standard="precision_standard", name="tnd_pa_multi_batch")


def _paged_base(**changes):
    case = AttentionCase(layout="BSND", mode=3, S2=32, D=16, D2=16, Dr=8, lengths=True, seed=13)
    paged = paged_arrays(case.arrays(), "BSND", 16, np.random.default_rng(5))
    paged.update(changes)
    return case, paged


@pytest.mark.parametrize("changes, attrs, rule, fact", [
    ({"value": np.zeros((8, 16, 16), np.float16)}, {}, "PA-S1", "input 2 'value': expected rank 4 (block_num, page, N2,"),
    ({"key_rope": np.zeros((8, 32, 1, 8), np.float16)}, {}, "PA-S1", "(BN, dim 0 of input 1 'key'), got 8"),
    ({"block_table": None}, {}, "PA-S2", "input 4 'block_table': expected a (B, max_blocks) int32 table"),
    ({"block_table": np.zeros(2, np.int32)}, {}, "PA-S2", "input 4 'block_table': expected rank 2 (B, max_blocks)"),
    ({"block_table": np.zeros((3, 2), np.int32)}, {}, "PA-S2", "input 4 'block_table' dim 0: expected 2 (B, dim 0 of"),
    ({"block_table": np.zeros((2, 0), np.int32)}, {}, "PA-S2", "input 4 'block_table' dim 1: expected >= 1"),
    ({"actual_seq_lengths_kv": None}, {}, "PA-S3", "input 6 'actual_seq_lengths_kv': expected a (B,) tensor"),
    ({"actual_seq_lengths_kv": np.zeros(3, np.int32)}, {}, "SA-S7b", "input 6 'actual_seq_lengths_kv' dim 0: expected 2"),
    ({}, {"sparse_block_size": 32}, "PA-S4", "expected a page size divisible by sparse_block_size = 32"),
    ({}, {"return_softmax_lse": True}, "PA-S5", "attribute 'return_softmax_lse': expected False"),
])
def test_every_paged_rule_names_tensor_dim_expected_and_actual(changes, attrs, rule, fact):
    case, paged = _paged_base(**changes)
    with pytest.raises(geir.GraphError) as err:
        _graph(paged, **_attrs(case, layout_kv="PA_BSND", **attrs))
    assert err.value.rule == rule and fact in str(err.value), str(err.value)


@pytest.mark.parametrize("page, fact", [(24, "expected a page size divisible by 16, got 24"),
                                        (2048, "expected a page size in 1..1024, got 2048")])
def test_page_size_rule(page, fact):
    case = AttentionCase(layout="BSND", mode=3, S2=32, D=16, D2=16, lengths=True, seed=13)
    paged = paged_arrays(case.arrays(), "BSND", page, np.random.default_rng(5))
    with pytest.raises(geir.GraphError, match=r"\[PA-S4\].*" + fact):
        _graph(paged, **_attrs(case, layout_kv="PA_BSND"))


def test_pa_s6_on_ascend950():
    """Changed by issue 27 (item 3): sinks with a paged cache are allowed on ascend950 since 2026-08
    (ops-transformer attention/sparse_flash_attention/op_host/sparse_flash_attention_tiling.cpp @16de349b:
    CheckSinks checks dtype and shape (N1,) only); PA-S6 keeps sparse_block_size == 1."""
    case, paged = _paged_base()
    paged["sinks"] = np.zeros(4, np.float32)
    assert "PA-S6" not in geir.check(_graph(paged, **_attrs(case, layout_kv="PA_BSND")), "ascend950").rules()
    assert "PA-S6" not in geir.check(_graph(paged, **_attrs(case, layout_kv="PA_BSND")), "ascend910b").rules()
    report = geir.check(_graph(paged, **_attrs(case, layout_kv="PA_BSND", sparse_block_size=2)), "ascend950")
    assert "PA-S6" in report.rules() and "expected 1 (with a paged cache on ascend950), got 2" in str(report)


@pytest.mark.parametrize("breaking, fact", [
    (lambda f: f["actual_seq_lengths_kv"].__setitem__(1, 999),
     "input 6 'actual_seq_lengths_kv' position 1: expected a key count in [0, 48] (max_blocks * page = 3 * 16)"),
    (lambda f: f["block_table"].__setitem__((0, 0), -1),
     "input 4 'block_table' entry (b=0, column=0), read by row (b=0, s1="),
    (lambda f: f["block_table"].__setitem__((1, 1), 99), "expected a page id in [0, 7) (block_num), got 99"),
])
def test_bad_lengths_and_pages_are_caught_on_both_runtimes_with_one_text(breaking, fact):
    case = AttentionCase(layout="BSND", mode=0, S2=32, D=16, D2=16, K=4, full=True, seed=14)
    arrays = case.arrays()
    arrays["actual_seq_lengths_kv"] = np.array([32, 32], np.int32)
    paged = paged_arrays(arrays, "BSND", 16, np.random.default_rng(6), spare_pages=3)
    graph = _graph(paged, **_attrs(case, layout_kv="PA_BSND"))
    feeds = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in _feeds(paged).items()}
    breaking(feeds)
    texts = []
    for runtime in ("numpy", "onnxruntime"):
        with pytest.raises(geir.ExecutionError) as err:
            geir.run(graph, feeds, runtime=runtime)
        texts.append(str(err.value))
    assert texts[0] == texts[1] and "[PA-D1]" in texts[0] and fact in texts[0], texts


def _one_page_read_through_a_huge_table(layout: str, columns: int) -> tuple[geir.Graph, dict]:
    """One batch whose two query rows read 2 keys of page 1 through a block table of ``columns`` columns (a
    1 MiB table at 2**18): all but the first column are -1 padding that no selection reaches."""
    rng = np.random.default_rng(21)
    lead = (1, 2) if layout == "BSND" else (2,)
    table = np.full((1, columns), -1, np.int32)
    table[0, 0] = 1
    arrays = {"query": rng.standard_normal(lead + (2, 8)).astype(np.float16),
              "key": rng.standard_normal((2, 16, 1, 8)).astype(np.float16),
              "value": rng.standard_normal((2, 16, 1, 8)).astype(np.float16),
              "sparse_indices": np.array([0, -1, 0, 1], np.int32).reshape(lead + (1, 2)), "block_table": table,
              "actual_seq_lengths_query": np.array([2], np.int32), "actual_seq_lengths_kv": np.array([2], np.int32)}
    graph = _graph(arrays, scale_value=0.25, layout_query=layout, layout_kv="PA_BSND", sparse_mode=3)
    return graph, arrays


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_a_huge_block_table_costs_memory_by_the_keys_read_not_by_its_size(layout):
    """Issue 23 item 24: the NumPy kernel used to gather max_blocks * page dense keys whatever the lengths said
    (160 MiB traced for this BSND case with a 1 MiB table, 2 keys read); it now reads keys through the table as it
    gathers them. The result is bit-identical to the same problem with a one-column table."""
    import tracemalloc

    graph, feeds = _one_page_read_through_a_huge_table(layout, 1)
    want = geir.run(graph, feeds)["attention_out"]
    graph, feeds = _one_page_read_through_a_huge_table(layout, 1 << 18)
    geir.run(graph, feeds)                            # once before measuring: imports and caches are not the point
    tracemalloc.start()
    try:
        got = geir.run(graph, feeds)["attention_out"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bits_equal(got, want)
    assert peak < 8 * feeds["block_table"].nbytes, f"{peak / 2**20:.1f} MiB traced for a 1 MiB table"


def test_the_function_body_reads_a_huge_block_table_by_the_keys_read_too():
    """Issue 23 item 24 for the ONNX function body (what ONNX Runtime runs without a C compiler): it gathered the
    max_blocks * page dense keys through a (B, max_blocks * page) row map; it now reads each candidate through the
    table. A fresh interpreter's peak memory may grow by far less than that would take (~300 MiB here)."""
    from native_helpers import run_isolated

    result = run_isolated("""
        import resource
        from sparse_attention import test_sfa_paged as case
        from oracles.onnx_runners import run_onnxruntime
        import geir
        peaks = []
        for columns in (1, 1 << 18):
            graph, feeds = case._one_page_read_through_a_huge_table("BSND", columns)
            out = run_onnxruntime(geir.to_onnx(graph), feeds)["attention_out"]
            peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        print((peaks[1] - peaks[0]) // 1024, out.shape)
    """, env={"PYTHONPATH": str(Path(__file__).parents[1])})
    assert result.returncode == 0, result.stderr[-3000:]
    grown, shape = result.stdout.split(maxsplit=1)
    assert shape.strip() == "(1, 2, 2, 8)"
    assert int(grown) < 48, f"peak memory grew by {grown} MiB for a 1 MiB table with 2 keys read"


def test_the_body_of_a_paged_cache_without_keys_never_reduces_over_an_empty_axis():
    """A TND query over a paged cache whose kv lengths are all 0 has no key at all: the body's candidate axis was
    empty, and ONNX Runtime 1.17 (the oldest supported) refuses a ReduceMax over it. The body keeps one (unread)
    candidate, as the NumPy kernel's candidate_grid does. Checked with onnx's evaluator given 1.17's ReduceMax."""
    import onnx.inliner
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.ops.op_reduce_max import ReduceMax_18

    class ReduceMax(ReduceMax_18):
        def _run(self, data: np.ndarray, axes: np.ndarray | None = None, keepdims: int = 1,
                 noop_with_empty_axes: int = 0) -> tuple[np.ndarray]:
            assert data.size, "ReduceMax over an empty axis (ONNX Runtime 1.17 fails there)"
            return super()._run(data, axes, keepdims=keepdims, noop_with_empty_axes=noop_with_empty_axes)

    graph, feeds = _one_page_read_through_a_huge_table("TND", 1)
    feeds["actual_seq_lengths_kv"] = np.zeros(1, np.int32)
    model = onnx.inliner.inline_local_functions(geir.to_onnx(graph))    # new_ops reach no function body otherwise
    out = ReferenceEvaluator(model, new_ops=[ReduceMax]).run(["attention_out"], feeds)[0]
    assert out.shape == (2, 2, 8) and not out.astype(np.float32).any()
