"""Data rules left to the native kernels: on ONNX Runtime, a node whose kernel checks its own data (MoE, sparse
attention) is not probed for before the run. Valid data runs once, with no probe session; data a kernel refuses
gives the very error the NumPy runtime gives (rule, node, entry), found by probing after the refusal; where the
library is not loaded, or the caller hands output buffers, the rules run before the run as before. The property
draws ids and lengths computed inside the graph, corrupted in every way the rules name, and holds both runtimes to
the same outcome."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geir
from geir import ExecutionError
from geir.runtimes.onnxruntime import OnnxRuntimeExecutable, native_library, native_status
from geir.runtimes.onnxruntime import _session
from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase, sfa_graph

pytestmark = pytest.mark.skipif(native_library() is None, reason=f"needs the native library: {native_status()}")

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
COMPUTED = ("sparse_indices", "actual_seq_lengths_query", "actual_seq_lengths_kv")


@pytest.fixture
def probes(monkeypatch) -> list[int]:
    """How many times an ONNX Runtime executable ran its probe session."""
    calls: list[int] = []
    real = OnnxRuntimeExecutable._probe

    def counted(self, arrays):
        calls.append(1)
        return real(self, arrays)
    monkeypatch.setattr(OnnxRuntimeExecutable, "_probe", counted)
    return calls


def _computed_graph(arrays: dict, op: str, attrs: dict) -> tuple[geir.Graph, dict[str, np.ndarray]]:
    """One attention node whose ids and lengths are computed inside the graph (fed + a constant 0), so that no
    runtime sees them from outside."""
    b = geir.GraphBuilder("computed")
    feeds, values = {}, {}
    for name, array in arrays.items():
        if array is None:
            continue
        feeds[name] = array
        values[name] = b.input(name, array.dtype, array.shape)
        if name in COMPUTED:
            values[name] = b.op("Add", values[name], b.constant(f"zero_{name}", np.zeros((), array.dtype)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", geir.GeirWarning)
        results = getattr(b, op)(**values, name="attention", **attrs)
    b.output(results[0], "first")
    return b.build(), feeds


def _forward(case: AttentionCase) -> tuple[geir.Graph, dict[str, np.ndarray]]:
    return _computed_graph(case.arrays(), SFA, case.forward_attrs())


def _outcome(graph: geir.Graph, feeds: dict[str, np.ndarray], runtime: str) -> str | np.ndarray:
    try:
        return geir.run(graph, feeds, runtime=runtime)["first"]
    except ExecutionError as exc:
        return str(exc)


def test_valid_computed_ids_run_without_a_probe(probes):
    graph, feeds = _forward(AttentionCase(layout="TND", mode=3, bs=2, seed=3))
    got = geir.run(graph, feeds, runtime="onnxruntime")["first"]
    assert probes == []
    want = geir.run(graph, feeds, runtime="numpy")["first"]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=5e-3, atol=5e-3)


def test_refused_ids_are_explained_as_the_numpy_runtime_explains_them(probes):
    case = AttentionCase(mode=0, K=3, seed=1)
    arrays = case.arrays()
    arrays["sparse_indices"][1, 2, 0] = [4, 4, -1]
    graph, feeds = _computed_graph(arrays, SFA, case.forward_attrs())
    theirs = _outcome(graph, feeds, "onnxruntime")
    assert probes == [1]          # after the kernel's refusal, to name the node and entry
    ours = _outcome(graph, feeds, "numpy")
    assert isinstance(theirs, str) and theirs == ours
    assert "[SA-D3]" in theirs and "'attention'" in theirs and "row (b=1, s1=2, n2=0) entry 1" in theirs


def test_output_buffers_are_checked_before_the_run(probes):
    """A refused run could leave the caller's buffer half written: with buffers the rules run first."""
    case = AttentionCase(mode=0, K=3, seed=1)
    arrays = case.arrays()
    arrays["sparse_indices"][0, 0, 0] = [7, 7, -1]
    graph, feeds = _computed_graph(arrays, SFA, case.forward_attrs())
    buffer = np.full(arrays["query"].shape[:-1] + (case.D2,), 3, np.float16)
    with pytest.raises(ExecutionError, match=r"\[SA-D3\]"):
        geir.run(graph, feeds, runtime="onnxruntime", outputs={"first": buffer})
    assert probes == [1]
    assert (buffer == 3).all()


def test_without_the_library_the_probe_checks_first(probes, monkeypatch):
    monkeypatch.setattr(_session, "native_op_types", lambda: frozenset())
    graph, feeds = _forward(AttentionCase(seed=5))
    geir.run(graph, feeds, runtime="onnxruntime")
    assert probes == [1]


def test_a_failure_that_is_not_a_kernel_refusal_is_not_probed_for(probes, monkeypatch):
    graph, feeds = _forward(AttentionCase(seed=2))
    executable = _session.OnnxRuntimeRuntime().compile(graph)

    class Broken:
        def run(self, *args, **kwargs):
            raise RuntimeError("the provider ran out of memory")
    monkeypatch.setattr(executable, "session", Broken())
    with pytest.raises(ExecutionError, match="ran out of memory"):
        executable.run(feeds)
    assert probes == []


def test_moe_indices_refused_by_the_kernel_name_the_pair(probes):
    b = geir.GraphBuilder("moe_computed")
    raw = b.input("raw", "int32", (4,))
    indices = b.op("Add", raw, b.constant("zero", np.zeros((), np.int32)))
    y = b.MoeTokenUnpermute(b.input("tokens", "float32", (4, 3)), indices, b.input("probs", "float32", (2, 2)),
                            name="moe")
    b.output(y, "first")
    graph = b.build()
    feeds = {"tokens": np.ones((4, 3), np.float32), "raw": np.array([3, 0, 1, 2], np.int32),
             "probs": np.ones((2, 2), np.float32)}
    np.testing.assert_array_equal(geir.run(graph, feeds, runtime="onnxruntime")["first"], np.full((2, 3), 2.0))
    assert probes == []
    feeds["raw"] = np.array([3, 0, 3, 2], np.int32)
    theirs = _outcome(graph, feeds, "onnxruntime")
    assert theirs == _outcome(graph, feeds, "numpy")
    assert "[MU-D1]" in theirs and "positions 0 and 2" in theirs and probes == [1]


CORRUPTIONS = ("none", "repeat", "range", "negative", "pad inside", "lengths drop", "lengths over")


@st.composite
def corrupted_problems(draw):
    grad = draw(st.booleans())
    n2 = draw(st.sampled_from([1, 2]))
    case = AttentionCase(layout=draw(st.sampled_from(["BSND", "TND"])), N2=n2, N1=n2 * draw(st.sampled_from([1, 2])),
                         K=draw(st.integers(1, 4)), bs=draw(st.sampled_from([1, 2, 3])),
                         mode=draw(st.sampled_from([0, 3])), lengths=not grad and draw(st.booleans()),
                         seed=draw(st.integers(0, 2**16)))
    arrays = case.arrays()
    op, attrs = SFA, case.forward_attrs()
    if grad:
        forward = geir.run(*sfa_graph(arrays, SFA, **attrs))
        rng = np.random.default_rng(case.seed)
        arrays = {"query": arrays["query"], "key": arrays["key"], "value": arrays["value"],
                  "sparse_indices": arrays["sparse_indices"],
                  "d_out": rng.standard_normal(forward["attention_out"].shape).astype(np.float16),
                  "out": forward["attention_out"], "softmax_max": forward["softmax_max"],
                  "softmax_sum": forward["softmax_sum"],
                  "actual_seq_lengths_query": arrays["actual_seq_lengths_query"] if case.layout == "TND" else None,
                  "actual_seq_lengths_kv": arrays["actual_seq_lengths_kv"] if case.layout == "TND" else None}
        op, attrs = SFA_GRAD, case.grad_attrs()
    how = draw(st.sampled_from(CORRUPTIONS))
    rows = arrays["sparse_indices"].reshape(-1, case.K)
    row = rows[draw(st.integers(0, rows.shape[0] - 1))]
    entry = draw(st.integers(0, case.K - 1))
    if how == "repeat" and case.K > 1:
        row[entry] = row[entry - 1]
    elif how == "range":
        row[entry] = draw(st.sampled_from([case.S2, 10**6, 2**31 - 1]))
    elif how == "negative":
        row[entry] = draw(st.sampled_from([-2, -(2**31)]))
    elif how == "pad inside" and case.K > 1:
        row[entry - 1], row[entry] = -1, max(row[entry], 0)
    lengths = arrays["actual_seq_lengths_query"]
    if how.startswith("lengths") and lengths is not None:
        at = draw(st.integers(0, lengths.size - 1))
        lengths[at] = -1 if how == "lengths drop" else 10**6
    return _computed_graph(arrays, op, attrs)


@SETTINGS
@given(corrupted_problems())
def test_the_kernels_refuse_exactly_what_the_rules_refuse(problem):
    graph, feeds = problem
    ours, theirs = (_outcome(graph, feeds, runtime) for runtime in ("numpy", "onnxruntime"))
    if isinstance(ours, str) or isinstance(theirs, str):
        assert ours == theirs
        return
    np.testing.assert_allclose(theirs.astype(np.float32), ours.astype(np.float32), rtol=5e-3, atol=5e-3)
