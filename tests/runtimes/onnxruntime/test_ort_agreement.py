"""geir's ONNX Runtime runtime gives exactly what plain ONNX Runtime gives on the exported model (issue 23: one
meaning everywhere): every output's name, dtype, shape and bits, with and without caller buffers, over the graph
shapes that take the runtime's IOBinding path (pass-through and constant outputs, 0-d values, symbolic and
data-dependent shapes, inputs with defaults, inner values that are outputs, multi-output nodes)."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest

import geir
from geir.runtimes import get_runtime
from oracles.numerics import assert_within_ulps_of_scale
from sparse_attention.helpers import AttentionCase

Case = tuple[geir.Graph, dict[str, object], dict[str, object]]
"""A graph and two sets of feeds (a second run of one executable must not disturb the first's results)."""


def _axes(b: geir.GraphBuilder, name: str = "axes") -> geir.Value:
    return b.constant(name, np.array([0], np.int64))


def _unsqueezed_scalar() -> Case:
    """The reported graph: z = x + Unsqueeze(s) with x passed through (z came back (1, 1) instead of (1,))."""
    b = geir.GraphBuilder("unsqueezed_scalar")
    x, s = b.input("x", "float32", (1,)), b.input("s", "float32", ())
    b.output(b.op("Add", x, b.op("Unsqueeze", s, _axes(b))), "z")
    b.output(x)
    return b.build(), {"x": np.array([1.5], np.float32), "s": np.array(2.0, np.float32)}, \
        {"x": np.array([-1.0], np.float32), "s": np.float32(0.25)}


def _scalar_arithmetic() -> Case:
    """0-d inputs of three dtypes, 0-d outputs, both kinds of pass-through."""
    b = geir.GraphBuilder("scalars")
    s, t, k = b.input("s", "float16", ()), b.input("t", "float16", ()), b.input("k", "int64", ())
    b.output(b.op("Mul", s, t), "st")
    b.output(b.op("Cast", k, to=1), "kf")
    b.output(b.op("Shape", s), "shape")
    b.output(t)
    b.output(k)
    return b.build(), {"s": np.array(3, np.float16), "t": np.array(-0.5, np.float16), "k": np.array(7, np.int64)}, \
        {"s": np.array(1, np.float16), "t": np.array(4, np.float16), "k": np.array(-2, np.int64)}


def _constant_outputs() -> Case:
    """Graph constants as outputs (one 0-d) beside a value that reads them."""
    b = geir.GraphBuilder("constants")
    x = b.input("x", "float32", (2, 3))
    c, zero_d = b.constant("c", np.arange(3, dtype=np.float32)), b.constant("half", np.array(0.5, np.float32))
    b.output(b.op("Mul", b.op("Add", x, c), zero_d), "y")
    b.output(c)
    b.output(zero_d)
    rng = np.random.default_rng(1)
    return b.build(), {"x": rng.standard_normal((2, 3)).astype(np.float32)}, \
        {"x": rng.standard_normal((2, 3)).astype(np.float32).T.copy().T}


def _symbolic() -> Case:
    """Symbolic dims (the IOBinding path even without pass-through), a 0-d input broadcast, a transposed feed."""
    b = geir.GraphBuilder("symbolic")
    x, s = b.input("x", "float32", ("N", 2)), b.input("s", "float32", ())
    y = b.op("Add", x, b.op("Unsqueeze", s, b.constant("axes", np.array([0, 1], np.int64))))
    b.output(b.op("Transpose", y, perm=[1, 0]), "yt")
    b.output(b.op("ReduceSum", y, keepdims=0), "total")
    b.output(s)
    rng = np.random.default_rng(2)
    return b.build(), {"x": rng.standard_normal((2, 3)).astype(np.float32).T, "s": np.array(1.0, np.float32)}, \
        {"x": rng.standard_normal((1, 2)).astype(np.float32), "s": np.array(-3.0, np.float32)}


def _inner_outputs() -> Case:
    """An output another node reads, the outputs of one Split, and the input they come from."""
    b = geir.GraphBuilder("inner")
    x = b.input("x", "float32", (4, 2))
    y = b.op("Relu", x)
    b.output(y, "y")
    first, second = b.op("Split", y, axis=0, num_outputs=2)
    b.output(first, "first")
    b.output(b.op("Neg", second), "second")
    b.output(x)
    rng = np.random.default_rng(3)
    return b.build(), {"x": rng.standard_normal((4, 2)).astype(np.float32)}, \
        {"x": rng.standard_normal((4, 2)).astype(np.float32)}


def _data_dependent() -> Case:
    """A data-dependent shape (NonZero) next to a passed-through bool input and a 0-d count."""
    b = geir.GraphBuilder("data_dependent")
    mask = b.input("mask", "bool", (5,))
    rows = b.op("NonZero", mask)
    b.output(rows, "rows")
    b.output(b.op("Size", rows), "count")
    b.output(mask)
    return b.build(), {"mask": np.array([0, 1, 1, 0, 1], bool)}, {"mask": np.zeros(5, bool)}


def _defaults() -> Case:
    """An input with a default that is not fed, passed through and read."""
    b = geir.GraphBuilder("defaults")
    x = b.input("x", "float32", (3,))
    d = b.input("d", "float32", (), default=np.array(10.0, np.float32))
    b.output(b.op("Add", x, d), "y")
    b.output(d)
    return b.build(), {"x": np.arange(3, dtype=np.float32)}, {"x": np.ones(3, np.float32), "d": np.float32(-1)}


CASES: dict[str, Callable[[], Case]] = {f.__name__.lstrip("_"): f for f in (
    _unsqueezed_scalar, _scalar_arithmetic, _constant_outputs, _symbolic, _inner_outputs, _data_dependent, _defaults)}


def plain_onnxruntime(graph: geir.Graph, feeds: dict[str, object]) -> dict[str, np.ndarray]:
    """The exported model in a bare InferenceSession (no geir in the loop)."""
    session = ort.InferenceSession(geir.to_onnx(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {k: np.asarray(v) for k, v in feeds.items()})))


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert list(got) == list(want), what
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, (
            f"{what}: output {name!r}: {got[name].dtype}{list(got[name].shape)}, expected "
            f"{want[name].dtype}{list(want[name].shape)}")
        bits = np.dtype(f"u{want[name].dtype.itemsize}")
        assert np.array_equal(got[name].view(bits), want[name].view(bits)), f"{what}: output {name!r} values"


def test_the_reported_pass_through_graph_keeps_every_shape():
    graph, feeds, _ = _unsqueezed_scalar()
    for runtime in ("numpy", "onnxruntime"):
        got = geir.run(graph, feeds, runtime=runtime)
        assert got["z"].shape == (1,) and got["z"].tolist() == [3.5], runtime
        assert got["x"].shape == (1,) and got["x"].tolist() == [1.5], runtime


@pytest.mark.parametrize("case", list(CASES))
def test_onnxruntime_runtime_agrees_with_plain_onnxruntime(case):
    graph, first, second = CASES[case]()
    executable = get_runtime("onnxruntime").compile(graph)
    want_first, want_second = plain_onnxruntime(graph, first), plain_onnxruntime(graph, second)
    assert list(want_first) == [v.name for v in graph.outputs]
    got_first = executable.run(first)
    kept = {k: v.copy() for k, v in got_first.items()}
    _assert_same(got_first, want_first, f"{case}, run 1")
    _assert_same(executable.run(second), want_second, f"{case}, run 2")
    _assert_same(kept, got_first, f"{case}: run 1's results after run 2")
    _assert_same(geir.run(graph, second, runtime="numpy"), want_second, f"{case}, numpy runtime")
    # caller buffers (data-dependent outputs excepted: their size is the data's), for all outputs and for every other
    static = {name: np.full(a.shape, 7, a.dtype) for name, a in want_second.items() if name != "rows"}
    for buffers in (static, dict(list(static.items())[::2])):
        got = executable.run(second, outputs=buffers)
        assert all(got[name] is buffer for name, buffer in buffers.items())
        _assert_same(got, want_second, f"{case}, buffers for {sorted(buffers)}")


@pytest.mark.parametrize("case", list(CASES))
def test_results_share_no_memory_with_feeds_or_each_other(case):
    graph, feeds, _ = CASES[case]()
    arrays = [np.asarray(v) for v in feeds.values()] + list(graph.constants.values())
    for runtime in ("numpy", "onnxruntime"):
        got = list(geir.run(graph, feeds, runtime=runtime).values())
        for i, result in enumerate(got):
            assert not any(np.may_share_memory(result, other) for other in arrays + got[:i]), (runtime, i)


def _trailing_absent(op: str) -> geir.Graph:
    b = geir.GraphBuilder(f"absent_{op.lower()}")
    x = b.input("x", "float32", (1, 3, 1))
    if op == "Squeeze":           # no axes: every dim of size 1
        y = b.op("Squeeze", x)
    elif op == "Slice":           # no axes, no steps
        y = b.op("Slice", x, b.constant("starts", np.array([0, 1], np.int64)),
                 b.constant("ends", np.array([1, 3], np.int64)))
    elif op == "ReduceSum":       # no axes: all of them
        y = b.op("ReduceSum", x)
    elif op == "Clip":            # min absent, max present: the "" stays where a later input is present
        y = b.op("Clip", x, None, b.constant("hi", np.array(1.0, np.float32)))
    else:
        y = b.op(op, x)
    b.output(y, "y")
    return b.build()


@pytest.mark.parametrize("op", ["Squeeze", "Slice", "ReduceSum", "Clip"])
def test_absent_trailing_optional_inputs_run_everywhere(op):
    graph = _trailing_absent(op)
    node = geir.to_onnx(graph).graph.node[-1]
    assert node.op_type == op and list(node.input)[-1] != "", list(node.input)
    assert op != "Clip" or list(node.input) == ["x", "", "hi"]
    feeds = {"x": np.array([[[0.5], [2.0], [-3.0]]], np.float32)}
    want = {"Squeeze": [0.5, 2.0, -3.0], "Slice": [[[2.0], [-3.0]]], "ReduceSum": [[[-0.5]]],
            "Clip": [[[0.5], [1.0], [-3.0]]]}[op]
    assert plain_onnxruntime(graph, feeds)["y"].tolist() == want
    reimported = geir.from_onnx(geir.to_onnx(graph))
    for runtime in ("numpy", "onnxruntime"):
        assert geir.run(graph, feeds, runtime=runtime)["y"].tolist() == want, runtime
        assert geir.run(reimported, feeds, runtime=runtime)["y"].tolist() == want, runtime


@pytest.mark.parametrize("layout, dtype", [("BSND", "float16"), ("TND", "bfloat16")])
def test_grad_of_attention_summed_to_a_scalar_runs_on_onnxruntime(layout, dtype):
    """SparseFlashAttention (sinks) -> Cast to float32 -> ReduceSum over every axis: the derivative's cotangent
    grad_y is 0-d, and bound as (1,) it made the attention grad's d_out one rank too many ("d_out and out: expected
    the rank and dtype of query" from the native kernel; without it, grad_sinks of shape (5, 2) for (2,))."""
    shape = dict(B=1, S1=3, S2=6, N1=2, D=4, D2=4, K=3) if layout == "BSND" else dict(
        layout="TND", N1=2, D=4, D2=4, K=3, tnd_q=[2, 4], tnd_kv=[3, 7])
    case = AttentionCase(**shape, mode=3, sinks=True, dtype=dtype, seed=3)
    arrays = case.arrays()
    b = geir.GraphBuilder("attention_sum")
    inputs: dict[str, geir.Value] = {}
    for name, array in arrays.items():
        if array is not None and name in ("query", "key", "value", "sinks"):
            inputs[name] = b.input(name, str(array.dtype), array.shape)
        elif array is not None and name in ("sparse_indices", "actual_seq_lengths_query", "actual_seq_lengths_kv"):
            inputs[name] = b.constant(name, array)
    out = b.SparseFlashAttention(**inputs, **case.forward_attrs())[0]
    b.output(b.op("ReduceSum", b.op("Cast", out, to=1), keepdims=0), "y")
    derivative = geir.grad(b.build())
    feeds = {name: arrays[name] for name in ("query", "key", "value", "sinks")} | {"grad_y": np.array(1.5, np.float32)}
    want = geir.run(derivative, feeds, runtime="numpy")
    got = geir.run(derivative, feeds, runtime="onnxruntime")
    assert list(got) == ["y", "grad_query", "grad_key", "grad_value", "grad_sinks"]
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert_within_ulps_of_scale(got[name], array.astype(np.float64), array.dtype, ulps=4, what=name)
    assert want["grad_sinks"].shape == (2,) and np.abs(want["grad_sinks"]).max() > 0


def test_zero_size_and_bfloat16_scalars_beside_pass_through_outputs():
    """Feeds ONNX Runtime takes through an OrtValue (bfloat16) or that hold no element, 0-d and passed through, with
    and without caller buffers: the NumPy runtime's answer (plain ONNX Runtime has no NumPy type for bfloat16)."""
    b = geir.GraphBuilder("odd_feeds")
    x, s, t = b.input("x", "float16", (0, 2)), b.input("s", "float16", ()), b.input("t", "bfloat16", ())
    b.output(b.op("Add", x, s), "z")
    b.output(b.op("Mul", s, s), "w")
    b.output(b.op("Unsqueeze", t, _axes(b)), "u")
    for value in (x, s, t):
        b.output(value)
    graph = b.build()
    feeds = {"x": np.zeros((0, 2), np.float16), "s": np.array(1.5, np.float16), "t": np.array(2.5, ml_dtypes.bfloat16)}
    want = geir.run(graph, feeds, runtime="numpy")
    assert want["u"].shape == (1,) and want["w"].shape == () and want["z"].shape == (0, 2)
    buffers = {"w": np.zeros((), np.float16), "z": np.zeros((0, 2), np.float16), "u": np.zeros(1, ml_dtypes.bfloat16)}
    for outputs in (None, buffers):
        _assert_same(geir.run(graph, feeds, runtime="onnxruntime", outputs=outputs), want, f"buffers {outputs}")
