"""One contract on both runtimes: feeds and constants never modified, pass-through outputs, the same
fed-shape and data checks with the same messages."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import geir
from geir import ExecutionError
from geir.runtimes import runtime_names
from moe.helpers import moe_graph
from sparse_attention.helpers import sfa_graph

RUNTIMES = runtime_names()


def _dropout_then_rotary(source: str) -> tuple[geir.Graph, dict[str, np.ndarray]]:
    """Dropout (onnx.reference returns its input object) feeding an in-place rotary grad."""
    b = geir.GraphBuilder("alias")
    x = b.input("x", "float32", (1, 2, 1, 4)) if source == "feed" else b.constant("x", np.arange(8, dtype=np.float32)
                                                                                    .reshape(1, 2, 1, 4))
    cos = b.input("cos", "float32", (1, 2, 1, 4))
    y = b.op("Dropout", x)[0]
    b.output(b.InplacePartialRotaryMulGrad(y, cos, cos, rotary_mode=1, partial_slice=[0, 4]), "dx")
    feeds = {"cos": np.full((1, 2, 1, 4), 0.5, np.float32)}
    if source == "feed":
        feeds["x"] = np.arange(8, dtype=np.float32).reshape(1, 2, 1, 4).copy()   # owns its data
    return b.build(), feeds


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("source", ["feed", "constant"])
def test_in_place_op_after_an_aliasing_standard_kernel_leaves_feeds_and_constants_alone(runtime, source):
    g, feeds = _dropout_then_rotary(source)
    before = {k: v.copy() for k, v in feeds.items()}
    constants = {k: v.copy() for k, v in g.constants.items()}
    first = geir.run(g, feeds, runtime=runtime)["dx"]
    second = geir.run(g, feeds, runtime=runtime)["dx"]
    assert all(np.array_equal(before[k], feeds[k]) for k in feeds)
    assert all(np.array_equal(constants[k], g.constants[k]) for k in constants)
    np.testing.assert_array_equal(first, second)
    x = np.arange(8, dtype=np.float32).reshape(1, 2, 1, 4)
    want = 0.5 * x + 0.5 * x[..., [1, 0, 3, 2]] * np.array([1, -1, 1, -1], np.float32)
    np.testing.assert_allclose(first, want, rtol=1e-6)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_view_of_an_owned_value_is_not_overwritten_by_a_later_in_place_op(runtime):
    b = geir.GraphBuilder("views")
    x = b.input("x", "float32", (1, 1, 1, 4))
    c = b.input("c", "float32", (1, 1, 1, 4))
    first = b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 4])
    view = b.op("Reshape", first, b.constant("shape", np.array([4], np.int64)))
    second = b.InplacePartialRotaryMulGrad(first, c, c, rotary_mode=1, partial_slice=[0, 4])
    b.output(view, "view")
    b.output(second, "twice")
    g = b.build()
    feeds = {"x": np.array([1, 2, 3, 4], np.float32).reshape(1, 1, 1, 4), "c": np.ones((1, 1, 1, 4), np.float32)}
    once = geir.run(g, feeds, runtime=runtime)
    # dx = c*dy + s*swap: with c = s = 1, [1,2,3,4] -> [1+2, 2-1, 3+4, 4-3]
    np.testing.assert_array_equal(once["view"], [3, 1, 7, 1])
    np.testing.assert_array_equal(once["twice"].reshape(-1), [4, -2, 8, -6])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_graph_input_that_is_also_an_output_is_returned_as_fed(runtime):
    b = geir.GraphBuilder("passthrough")
    x = b.input("x", "float16", ("B", 2, 1, 4))
    c = b.input("c", "float16", (1, 2, 1, 4))
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 4]), "dx")
    b.output(x)
    b.output(c)
    g = b.build()
    rng = np.random.default_rng(0)
    for batch in (3, 1, 2):   # a symbolic shape: nothing of an earlier run may come back
        feeds = {"x": rng.standard_normal((batch, 2, 1, 4)).astype(np.float16),
                 "c": rng.standard_normal((1, 2, 1, 4)).astype(np.float16)}
        out = geir.run(g, feeds, runtime=runtime)
        np.testing.assert_array_equal(out["x"], feeds["x"])
        np.testing.assert_array_equal(out["c"], feeds["c"])
        assert not np.shares_memory(out["x"], feeds["x"])


def _same_error_on_both(graph: geir.Graph, feeds: dict[str, np.ndarray], rule: str) -> str:
    """Both runtimes raise ExecutionError with the same text, naming ``rule``; return the text."""
    messages = []
    for runtime in RUNTIMES:
        with pytest.raises(ExecutionError) as info:
            geir.run(graph, feeds, runtime=runtime)
        assert info.value.rule == rule, (runtime, str(info.value))
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert f"[{rule}]" in messages[0]
    return messages[0]


def _sfa_with_computed_indices(indices: np.ndarray, layout: str = "BSND"):
    """A forward whose sparse_indices are computed inside the graph (fed indices + a constant 0)."""
    from sparse_attention.helpers import AttentionCase

    case = AttentionCase(layout=layout, B=1, S1=3, S2=8, N1=2, K=4, bs=2, mode=0)
    arrays = case.arrays()
    b = geir.GraphBuilder("computed_indices")
    feeds = {k: v for k, v in arrays.items() if v is not None and k != "sparse_indices"}
    values = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items()}
    raw = b.input("raw_indices", "int32", indices.shape)
    values["sparse_indices"] = b.op("Add", raw, b.constant("zero", np.zeros((), np.int32)))
    outs = b.SparseFlashAttention(**values, **case.forward_attrs(), name="sfa")
    b.output(outs[0], "attention_out")
    feeds["raw_indices"] = indices
    return b.build(), feeds


@pytest.mark.parametrize("row, what", [([0, 4, -1, -1], "in [0, 4)"), ([1, 1, -1, -1], "repeat"),
                                       ([0, -1, 2, -1], "-1")])
def test_sfa_indices_computed_inside_the_graph_are_validated_on_both_runtimes(row, what):
    indices = np.tile(np.array([0, 1, -1, -1], np.int32), (1, 3, 1, 1))
    indices[0, 1, 0] = row
    graph, feeds = _sfa_with_computed_indices(indices)
    text = _same_error_on_both(graph, feeds, "SA-D3")
    assert "'sfa'" in text and "s1=1" in text
    valid = np.tile(np.array([0, 1, -1, -1], np.int32), (1, 3, 1, 1))
    feeds["raw_indices"] = valid
    ours, theirs = (geir.run(graph, feeds, runtime=r)["attention_out"] for r in RUNTIMES)
    np.testing.assert_allclose(theirs.astype(np.float32), ours.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("op", ["forward", "grad"])
def test_moe_indices_computed_inside_the_graph_are_validated_on_both_runtimes(op):
    b = geir.GraphBuilder("moe_computed")
    tokens = b.input("tokens", "float32", (4, 3))
    raw = b.input("raw", "int32", (4,))
    probs = b.input("probs", "float32", (2, 2))
    indices = b.op("Add", raw, b.constant("zero", np.zeros((), np.int32)))
    if op == "forward":
        b.output(b.MoeTokenUnpermute(tokens, indices, probs, name="moe"), "y")
        rule = "MU-D1"
    else:
        dy = b.input("dy", "float32", (2, 3))
        ptg, pg = b.MoeTokenUnpermuteGrad(tokens, dy, indices, probs, name="moe")
        b.output(ptg, "ptg")
        b.output(pg, "pg")
        rule = "MG-D1"
    g = b.build()
    feeds = {"tokens": np.ones((4, 3), np.float32), "raw": np.array([0, 2, 2, 1], np.int32),
             "probs": np.ones((2, 2), np.float32)}
    if op == "grad":
        feeds["dy"] = np.ones((2, 3), np.float32)
    text = _same_error_on_both(g, feeds, rule)
    assert "'moe'" in text and "positions 1 and 2" in text


def test_fed_zero_size_tensor_is_refused_on_both_runtimes():
    # The forward: since issue 27 (item 3) an empty dy makes the grad the identity (the arch35 tiling's
    # empty-tensor key), which the fed grad below shows on both runtimes; RP-S6 binds the forward only.
    b = geir.GraphBuilder("zero")
    x = b.input("x", "float32", ("B", 2, 1, 4))
    c = b.input("c", "float32", (1, 2, 1, 4))
    b.output(b.InplacePartialRotaryMul(x, c, c, rotary_mode=1, partial_slice=[0, 4], name="rope"), "dx")
    g = b.build()
    feeds = {"x": np.ones((0, 2, 1, 4), np.float32), "c": np.ones((1, 2, 1, 4), np.float32)}
    text = _same_error_on_both(g, feeds, "RP-S6")
    assert "'rope'" in text and "dim 0" in text and "on the fed shapes" in text
    b = geir.GraphBuilder("zero_grad")
    x, c = b.input("x", "float32", ("B", 2, 1, 4)), b.input("c", "float32", (1, 2, 1, 4))
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 4], name="rope_grad"), "dy")
    grad = b.build()
    for runtime in RUNTIMES:
        assert geir.run(grad, feeds, runtime=runtime)["dy"].shape == (0, 2, 1, 4)


def test_fed_moe_length_mismatch_is_refused_on_both_runtimes():
    b = geir.GraphBuilder("moe_sym")
    dy = b.input("dy", "float32", ("T", 3))
    indices = b.input("indices", "int32", (6,))     # M == T * 1 is decided only on the fed T
    ptg, pg = b.MoeTokenUnpermuteGrad(None, dy, indices, name="moe")
    b.output(ptg, "ptg")
    b.output(pg, "pg")
    g = b.build()
    text = _same_error_on_both(g, {"dy": np.ones((2, 3), np.float32), "indices": np.arange(6, dtype=np.int32)},
                               "MG-S2")
    assert "'moe'" in text


def _sfa_symbolic(layout: str, lengths: int = 1, d2: int | str = "D"):
    """A forward with symbolic leading dims and static length tensors: their rules wait for the feeds."""
    lead_q, lead_k = (("B", "S1"), ("B", "S2")) if layout == "BSND" else (("T1",), ("T2",))
    b = geir.GraphBuilder("sfa_sym")
    q = b.input("query", "float16", (*lead_q, 2, "D"))
    k = b.input("key", "float16", (*lead_k, 1, "D"))
    v = b.input("value", "float16", (*lead_k, 1, d2))
    idx = b.input("sparse_indices", "int32", (*lead_q, 1, 2))
    aq = b.input("actual_seq_lengths_query", "int32", (lengths,))
    akv = b.input("actual_seq_lengths_kv", "int32", (lengths,))
    outs = b.SparseFlashAttention(q, k, v, idx, None, aq, akv, scale_value=0.5, layout_query=layout,
                                  layout_kv=layout, sparse_mode=0, name="sfa")
    b.output(outs[0], "attention_out")
    return b.build()


def _sfa_feeds(layout: str, batch: int, lengths: int, d2: int = 4) -> dict[str, np.ndarray]:
    lead_q, lead_k = ((batch, 3), (batch, 4)) if layout == "BSND" else ((3,), (4,))
    return {"query": np.ones((*lead_q, 2, 4), np.float16), "key": np.ones((*lead_k, 1, 4), np.float16),
            "value": np.ones((*lead_k, 1, d2), np.float16),
            "sparse_indices": np.zeros((*lead_q, 1, 2), np.int32) - 1,
            "actual_seq_lengths_query": np.full(lengths, 3, np.int32),
            "actual_seq_lengths_kv": np.full(lengths, 4, np.int32)}


def test_fed_sfa_length_tensor_of_the_wrong_length_is_refused_on_both_runtimes():
    g = _sfa_symbolic("BSND", lengths=2)
    text = _same_error_on_both(g, _sfa_feeds("BSND", batch=1, lengths=2), "SA-S7b")
    assert "'sfa'" in text and "actual_seq_lengths_query" in text
    ok = _sfa_feeds("BSND", batch=2, lengths=2)
    for runtime in RUNTIMES:
        assert geir.run(g, ok, runtime=runtime)["attention_out"].shape == (2, 3, 2, 4)


def test_fed_sfa_value_wider_than_key_is_refused_on_both_runtimes():
    g = _sfa_symbolic("BSND", d2=8)
    _same_error_on_both(g, _sfa_feeds("BSND", batch=1, lengths=1, d2=8), "SA-S5")


def test_declared_equal_symbols_export_as_one_dim_param_and_run_on_both_runtimes():
    b = geir.GraphBuilder("equal")
    dy = b.input("dy", "float32", ("T", 3))
    indices = b.input("indices", "int32", ("M",))
    b.declare_equal("T", "M")
    ptg, pg = b.MoeTokenUnpermuteGrad(None, dy, indices, name="moe")
    b.output(ptg, "ptg")
    b.output(pg, "pg")
    g = b.build()
    model = geir.to_onnx(g)
    params = {d.dim_param for vi in [*model.graph.input, *model.graph.output] for d in vi.type.tensor_type.shape.dim
              if d.dim_param}
    assert params == {"M"}
    feeds = {"dy": np.arange(12, dtype=np.float32).reshape(4, 3), "indices": np.array([2, 0, 3, 1], np.int32)}
    ours, theirs = (geir.run(g, feeds, runtime=r) for r in RUNTIMES)
    np.testing.assert_array_equal(theirs["ptg"], ours["ptg"])
    np.testing.assert_array_equal(ours["ptg"][feeds["indices"]], feeds["dy"])
    again = geir.from_onnx(model)
    np.testing.assert_array_equal(geir.run(again, feeds)["ptg"], ours["ptg"])


def test_unequal_symbols_error_names_declare_equal():
    b = geir.GraphBuilder("unequal")
    dy = b.input("dy", "float32", ("T", 3))
    indices = b.input("indices", "int32", ("M",))
    with pytest.raises(geir.GraphError, match=r"\[MG-S2\].*got M; .*declare_equal\('T', 'M'\)"):
        b.MoeTokenUnpermuteGrad(None, dy, indices, name="moe")


def test_feeds_of_exact_dtype_and_shape_take_the_short_check_and_others_the_full_one():
    """The short path (a few comparisons per feed) accepts only what the full check accepts, unchanged."""
    from geir.runtimes._feeds import validate_feeds

    b = geir.GraphBuilder("short")
    x = b.input("x", "float32", (2, 3))
    b.output(b.op("Identity", x), "y")
    g = b.build()
    exact = np.ones((2, 3), np.float32)
    arrays, bindings = validate_feeds(g, {"x": exact})
    assert arrays["x"] is exact and bindings == {}
    swapped = exact.astype(">f4")                       # same values, other byte order: converted, not refused
    assert validate_feeds(g, {"x": swapped})[0]["x"].dtype == np.float32
    for feeds, message in [({"x": exact.astype(np.float64)}, "expected dtype float32, got float64"),
                           ({"x": np.ones((3, 2), np.float32)}, "dim 0: expected 2, got 3"),
                           ({"x": exact, "z": exact}, r"unexpected feed\(s\) \['z'\]"),
                           ({"z": exact}, r"unexpected feed\(s\) \['z'\]")]:
        with pytest.raises(geir.ExecutionError, match=message):
            validate_feeds(g, feeds)


ZERO_SIZE_MOE = {   # (rows, hidden, slots, probs shape): spec 3.2 accepts zero-size tensors in the forward
    "top_k_0": (4, 64, 0, (3, 0)),          # three tokens, no slot each: three empty sums
    "no_tokens": (4, 64, 0, (0, 2)),
    "no_rows": (0, 64, 6, (3, 2)),          # every slot dropped
    "no_hidden": (4, 0, 4, (2, 2)),
}


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", sorted(ZERO_SIZE_MOE))
def test_moe_forward_of_zero_size_tensors_gives_positive_zeros(runtime, dtype, case):
    """out[t] is an empty sum, or one of dropped slots only: +0 on both runtimes (before: topK = 0 divided by zero
    on the NumPy runtime and returned uninitialised memory from the native kernel)."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    warm = moe_graph(8, 64, 8, (4, 2), dtype)              # a run first, so freed memory holds other values
    geir.run(warm, {"tokens": np.full((8, 64), 3, np_dtype), "indices": np.arange(8, dtype=np.int32)[::-1].copy(),
                    "probs": np.full((4, 2), 0.5, np_dtype)}, runtime=runtime)
    rows, hidden, slots, probs_shape = ZERO_SIZE_MOE[case]
    g = moe_graph(rows, hidden, slots, probs_shape, dtype)
    feeds = {"tokens": np.full((rows, hidden), 7, np_dtype), "indices": np.arange(slots, dtype=np.int32),
             "probs": np.full(probs_shape, 0.25, np_dtype)}
    y = np.asarray(geir.run(g, feeds, runtime=runtime)["y"], np.float32)
    assert y.shape == (probs_shape[0], hidden)
    assert not y.any() and not np.signbit(y).any()


def test_moe_forward_bodies_of_zero_size_tensors_give_positive_zeros():
    """Issue 23 item 18: the ONNX function body (what ONNX Runtime runs without a C compiler) failed on a Gather from
    zero rows (every slot dropped) and on a Reshape to (Tn, 0) (top K = 0, ONNX's 0 means 'copy the dim')."""
    import ml_dtypes
    from oracles.onnx_runners import run_onnxruntime

    for dtype in ("float32", "float16", "bfloat16"):
        np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        for case, (rows, hidden, slots, probs_shape) in sorted(ZERO_SIZE_MOE.items()):
            g = moe_graph(rows, hidden, slots, probs_shape, dtype)
            feeds = {"tokens": np.full((rows, hidden), 7, np_dtype), "indices": np.arange(slots, dtype=np.int32),
                     "probs": np.full(probs_shape, 0.25, np_dtype)}
            y = np.asarray(run_onnxruntime(geir.to_onnx(g), feeds)["y"], np.float32)
            assert y.shape == (probs_shape[0], hidden), (dtype, case)
            assert not y.any() and not np.signbit(y).any(), (dtype, case)


def _skipped_slots_case(np_dtype) -> tuple[geir.Graph, dict[str, np.ndarray], np.ndarray]:
    """Two tokens of two slots, each with one dropped slot (row >= R) whose weight is NaN or inf, and a zero
    weight on a row of infinities: the reference skips all three, so they change nothing."""
    g = moe_graph(2, 16, 4, (2, 2), "float32" if np_dtype == np.float32 else np.dtype(np_dtype).name)
    tokens = np.ones((2, 16), np.float32)
    tokens[1] = np.inf
    feeds = {"tokens": tokens.astype(np_dtype), "indices": np.array([0, 3, 1, 2], np.int32),
             "probs": np.array([[0.5, np.nan], [0.0, np.inf]], np.float32).astype(np_dtype)}
    # token 0: row 0 * 0.5 + row 3 dropped (NaN weight); token 1: row 1 (inf) * 0 skipped + row 2 dropped (inf)
    return g, feeds, np.array([[0.5] * 16, [0.0] * 16], np.float32)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_moe_forward_never_reads_the_weight_of_a_dropped_slot(runtime, dtype):
    """Spec 3.3 skips a dropped slot before reading its weight; the kernels added row 0 * weight, so a NaN or
    inf weight there made the whole output row NaN (while the ONNX bodies gave the reference's result)."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    g, feeds, want = _skipped_slots_case(np_dtype)
    got = np.asarray(geir.run(g, feeds, runtime=runtime)["y"], np.float32)
    np.testing.assert_array_equal(got, want)
    assert not np.signbit(got).any()


def test_moe_forward_bodies_skip_dropped_slots_too():
    """The ONNX function bodies (what ONNX Runtime runs without the native library) give the same result."""
    printed = _on_the_bodies("""
        import numpy as np, geir
        import test_one_contract as case
        g, feeds, want = case._skipped_slots_case(np.float32)
        got = geir.run(g, feeds, runtime="onnxruntime")["y"]
        from geir.runtimes.onnxruntime import native_library
        print(native_library(), np.array_equal(got, want))
    """)
    assert printed == "None True"


def _special_attention_case(dtype: str, inject: str):
    """A small forward whose inputs hold one kind of non-finite value (or none), with one row that selects no key."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    query = rng.uniform(-1, 1, (1, 4, 2, 8)).astype(np.float32)
    key = rng.uniform(-1, 1, (1, 8, 1, 8)).astype(np.float32)
    value = rng.uniform(-1, 1, (1, 8, 1, 8)).astype(np.float32)
    sinks = np.array([0.25, -0.5], np.float32)
    indices = np.array([[0, 3, 5], [-1, -1, -1], [1, 2, -1], [4, 6, 7]], np.int32).reshape(1, 4, 1, 3)
    if inject == "inf_sink":
        sinks[0] = np.inf
    elif inject == "nan_key":
        key[0, 3, 0, 2] = np.nan                 # selected by row 0 only
    elif inject == "inf_key":
        key[0, 6, 0, 1] = np.inf                 # row 3: a score of +inf or -inf per head
    elif inject == "neg_inf_query":
        query[0, 2, 1, :] = -np.inf              # row 2, head 1: every score infinite or NaN
    elif inject == "nan_unread_value":
        value[0, 0, 0, 1] = np.nan               # read by row 0 only; padded candidates elsewhere clamp to row 0
    feeds = {"query": query.astype(np_dtype), "key": key.astype(np_dtype), "value": value.astype(np_dtype),
             "sparse_indices": indices, "sinks": sinks}
    return feeds, dict(scale_value=0.35, sparse_mode=0, return_softmax_lse=True)


SPECIAL_ATTENTION = ["finite", "inf_sink", "nan_key", "inf_key", "neg_inf_query", "nan_unread_value"]


def _assert_like_the_reference(got: dict, feeds: dict, attrs: dict, dtype: str) -> None:
    """NaN and infinities where the spec's formula (IEEE, float64 oracle) has them; finite values close to it."""
    from oracles.sfa import forward_reference

    with np.errstate(all="ignore"):                      # inf - inf is the point here
        want = forward_reference(feeds["query"], feeds["key"], feeds["value"], feeds["sparse_indices"],
                                 scale=np.float32(attrs["scale_value"]), mode=attrs["sparse_mode"],
                                 sinks=feeds["sinks"], round_to=np.dtype(feeds["query"].dtype))
    _assert_like(got, ("attention_out", "softmax_max", "softmax_sum"), want, 2e-2)


def _assert_like(got: dict, names: tuple[str, ...], want, tolerance: float) -> None:
    """NaN, +inf and -inf exactly where the reference has them; finite values within ``tolerance``."""
    for name, reference in zip(names, want):
        value = np.asarray(got[name], np.float64)
        reference = np.asarray(reference, np.float64)
        for kind in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(kind(value), kind(reference), err_msg=f"{name}: {kind.__name__}")
        finite = np.isfinite(reference)
        np.testing.assert_allclose(value[finite], reference[finite], rtol=tolerance, atol=tolerance, err_msg=name)


def _on_the_bodies(code: str) -> str:
    """Run ``code`` in a fresh interpreter whose ONNX Runtime has no native library (its function bodies run), with
    this folder and tests/ importable; return what it printed."""
    from native_helpers import run_isolated

    here = Path(__file__).parent
    result = run_isolated(code, env={"GEIR_NATIVE": "0", "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("inject", SPECIAL_ATTENTION)
def test_attention_non_finite_values_follow_the_spec_formula(runtime, dtype, inject):
    """An infinite or NaN row maximum goes through the formula in IEEE arithmetic (spec 1: NaN/Inf follow IEEE): the
    kernels used to replace it by 0, so an infinite sink gave out 0 and sum inf where the formula gives NaN, and a
    row without a key and an infinite sink differed between the NumPy and native kernels."""
    feeds, attrs = _special_attention_case(dtype, inject)
    g, feeds = sfa_graph(feeds, **attrs)
    _assert_like_the_reference(geir.run(g, feeds, runtime=runtime), feeds, attrs, dtype)


def test_attention_bodies_follow_the_spec_formula_on_non_finite_values():
    """The same cases through ONNX Runtime's function bodies (no native library)."""
    printed = _on_the_bodies("""
        import geir
        import test_one_contract as case
        from sparse_attention.helpers import sfa_graph
        from geir.runtimes.onnxruntime import native_library
        for dtype in ("float16", "bfloat16"):
            for inject in case.SPECIAL_ATTENTION:
                feeds, attrs = case._special_attention_case(dtype, inject)
                g, feeds = sfa_graph(feeds, **attrs)
                case._assert_like_the_reference(geir.run(g, feeds, runtime="onnxruntime"), feeds, attrs, dtype)
        print(native_library(), "ok")
    """)
    assert printed == "None ok"


GRAD_STATS = ["as_computed", "nan_sum", "inf_max", "zero_sum", "nan_unread_key", "inf_value", "inf_query", "inf_d_out"]


def _special_grad_case(dtype: str, stats: str):
    """The finite forward case's grad, with one row's statistics replaced by a non-finite or zero value, or one input
    value made non-finite after the forward (the grad must carry it exactly where the spec's loops do)."""
    from oracles.sfa import forward_reference

    feeds, attrs = _special_attention_case(dtype, "finite")
    del feeds["sinks"]
    with np.errstate(all="ignore"):
        out, mx, sm = forward_reference(feeds["query"], feeds["key"], feeds["value"], feeds["sparse_indices"],
                                        scale=np.float32(attrs["scale_value"]), mode=0,
                                        round_to=np.dtype(feeds["query"].dtype))
    mx, sm = mx.astype(np.float32), sm.astype(np.float32)
    if stats == "nan_sum":
        sm[0, 0, 2, 1] = np.nan
    elif stats == "inf_max":
        mx[0, 0, 3, 0] = np.inf
    elif stats == "zero_sum":
        sm[0, 0, 0, 0] = 0.0
    elif stats == "nan_unread_key":
        feeds["key"][0, 0, 0, 1] = np.nan        # read by row 0 only: no other row's dQ may see it
    elif stats == "inf_value":
        feeds["value"][0, 1, 0, 0] = np.inf
    elif stats == "inf_query":
        feeds["query"][0, 2, 1, 3] = np.inf      # row 2 reads keys 1 and 2 only
    d_out = np.random.default_rng(3).uniform(-1, 1, out.shape).astype(feeds["query"].dtype)
    if stats == "inf_d_out":
        d_out[0, 0, 0, 2] = np.inf
    grad = {"query": feeds["query"], "key": feeds["key"], "sparse_indices": feeds["sparse_indices"], "d_out": d_out,
            "out": out.astype(feeds["query"].dtype), "softmax_max": mx, "softmax_sum": sm, "value": feeds["value"]}
    return grad, {"scale_value": attrs["scale_value"], "sparse_mode": 0}


def _assert_grad_like_the_reference(got: dict, feeds: dict, attrs: dict) -> None:
    from oracles.sfa import grad_reference

    with np.errstate(all="ignore"):
        want = grad_reference(feeds["query"], feeds["key"], feeds["sparse_indices"], feeds["d_out"], feeds["out"],
                              feeds["softmax_max"], feeds["softmax_sum"], scale=np.float32(attrs["scale_value"]),
                              value=feeds["value"], mode=0, round_to=np.dtype(feeds["query"].dtype))
    _assert_like(got, ("d_query", "d_key", "d_value"), want, 3e-2)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("stats", GRAD_STATS)
def test_attention_grad_takes_the_statistics_as_they_are(runtime, dtype, stats):
    """The grad divides by the fed softmax_sum and subtracts the fed softmax_max in IEEE arithmetic on every
    runtime (the ONNX body used to replace a sum that is not > 0 by 1, hiding a NaN or zero sum of a read row), and
    a non-finite input reaches only what the spec's loops reach (the NumPy kernel's clamped stand-in keys and its
    dense dK/dV span used to carry 0 * inf = NaN to keys and rows that never read it)."""
    from sparse_attention.helpers import SFA_GRAD

    feeds, attrs = _special_grad_case(dtype, stats)
    g, feeds = sfa_graph(feeds, op=SFA_GRAD, **attrs)
    _assert_grad_like_the_reference(geir.run(g, feeds, runtime=runtime), feeds, attrs)


def test_attention_grad_bodies_take_the_statistics_as_they_are():
    """Also an infinite query or d_out value (issue 23 item 18): the body's dense dK/dV product met it with the 0
    weight of every key its row does not read (0 * inf = NaN on keys no row with it reads); it now sums the finite
    terms densely and adds the non-finite ones per key read."""
    printed = _on_the_bodies("""
        import geir
        import test_one_contract as case
        from sparse_attention.helpers import SFA_GRAD, sfa_graph
        from geir.runtimes.onnxruntime import native_library
        for dtype in ("float16", "bfloat16"):
            for stats in case.GRAD_STATS:
                feeds, attrs = case._special_grad_case(dtype, stats)
                g, feeds = sfa_graph(feeds, op=SFA_GRAD, **attrs)
                case._assert_grad_like_the_reference(geir.run(g, feeds, runtime="onnxruntime"), feeds, attrs)
        print(native_library(), "ok")
    """)
    assert printed == "None ok"


def _no_key_read_case(which: str, mode: int) -> tuple[geir.Graph, dict[str, np.ndarray]]:
    """A graph in which no query row reads a key: the TND grad with every kv length 0 (one query row outside every
    batch), or the paged forward with every kv length 0 (with a TND query its dense problem has no key at all)."""
    rng = np.random.default_rng(mode)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float16)

    if which == "grad_tnd":
        feeds = {"query": normal(3, 2, 8), "key": normal(4, 1, 8), "sparse_indices": np.zeros((3, 1, 2), np.int32),
                 "d_out": normal(3, 2, 8), "out": normal(3, 2, 8), "softmax_max": np.ones((1, 3, 2), np.float32),
                 "softmax_sum": np.ones((1, 3, 2), np.float32), "value": normal(4, 1, 8),
                 "actual_seq_lengths_query": np.array([2], np.int32), "actual_seq_lengths_kv": np.array([0], np.int32),
                 "query_rope": normal(3, 2, 4), "key_rope": normal(4, 1, 4)}
        return sfa_graph(feeds, op="SparseFlashAttentionGrad", scale_value=0.25, layout="TND", sparse_mode=mode)
    layout = which.removeprefix("paged_").upper()
    lead = (2, 2) if layout == "BSND" else (3,)
    feeds = {"query": normal(*lead, 2, 8), "key": normal(2, 16, 1, 8), "value": normal(2, 16, 1, 8),
             "sparse_indices": np.zeros(lead + (1, 2), np.int32), "block_table": np.array([[0], [1]], np.int32),
             "actual_seq_lengths_query": np.array([1, 2] if layout == "BSND" else [1, 3], np.int32),
             "actual_seq_lengths_kv": np.array([0, 0], np.int32), "query_rope": normal(*lead, 2, 4),
             "key_rope": normal(2, 16, 1, 4), "sinks": np.array([0.5, -1.0], np.float32)}
    return sfa_graph(feeds, scale_value=0.25, layout_query=layout, layout_kv="PA_BSND", sparse_mode=mode)


@pytest.mark.parametrize("how", ["numpy", "onnxruntime", "reference", "bodies"])
@pytest.mark.parametrize("which", ["grad_tnd", "paged_tnd", "paged_bsnd"])
@pytest.mark.parametrize("mode", [0, 3])
def test_attention_where_no_row_reads_a_key_gives_zeros_everywhere(how, which, mode):
    """Issue 23 item 17: spec 4.6/4.7's loops read no key, so every output stays 0 (the forward's statistics are
    (0,) without return_softmax_lse, which a paged cache requires). The NumPy kernels and geir.testing.reference
    raised an internal IndexError (the grad's empty work list, the paged TND forward's empty dense keys), while ONNX
    Runtime returned zeros."""
    from oracles.onnx_runners import run_onnxruntime

    g, feeds = _no_key_read_case(which, mode)
    if how == "reference":
        got = geir.testing.reference(g, feeds)
    elif how == "bodies":                                  # the function bodies: no custom-op library registered
        got = run_onnxruntime(geir.to_onnx(g), feeds)
    else:
        got = geir.run(g, feeds, runtime=how)
    shapes = {v.name: tuple(v.type.shape) for v in g.outputs}
    assert set(got) == set(shapes)
    for name, value in got.items():
        assert value.shape == shapes[name], (name, value.shape)
        assert np.array_equal(np.asarray(value, np.float32), np.zeros(value.shape, np.float32)), name
