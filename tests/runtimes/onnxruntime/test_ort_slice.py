"""Slice's ends under a negative step mean on ONNX Runtime what the ONNX spec says (issue 23 item 6): ONNX Runtime reads
an end of INT32_MAX or INT64_MAX as "through index 0", where the spec clamps it to dim - 1. The export writes such
ends as -1 (the same under the spec for every dim): constants directly, fed or computed ends through a Where. Checked
exhaustively on plain ONNX Runtime against the spec's positions (``slice_range``), on both runtimes, and against
onnx.reference: the exported model means what the plain Slice means there too."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import geir
from geir.schemas.onnx_slice import slice_range

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
STEPS = (-3, -2, -1, 1, 2, 3)
DTYPES = {"int64": np.int64, "int32": np.int32}


def _bounds(dim: int, dtype: type) -> list[int]:
    extremes = [INT32_MIN, INT32_MAX] + ([INT64_MIN, INT64_MAX] if dtype is np.int64 else [])
    return sorted(set(range(-dim - 2, dim + 3)) | set(extremes))


def _fed_graph(dtype: str) -> geir.Graph:
    b = geir.GraphBuilder(f"fed_slice_{dtype}")
    x = b.input("x", "float32", ("N",))
    starts, ends, steps = (b.input(name, dtype, (1,)) for name in ("starts", "ends", "steps"))
    b.output(b.op("Slice", x, starts, ends, None, steps), "y")
    return b.build()


def _session(graph: geir.Graph) -> ort.InferenceSession:
    return ort.InferenceSession(geir.to_onnx(graph).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fed_ends_mean_the_spec_on_plain_onnxruntime(dtype):
    """Every (dim, start, end, step) over the sentinels and the values around the axis, fed to the exported model."""
    np_dtype = DTYPES[dtype]
    session = _session(_fed_graph(dtype))
    checked = 0
    for dim in range(5):
        x = np.arange(dim, dtype=np.float32)
        for start, end, step in itertools.product(_bounds(dim, np_dtype), _bounds(dim, np_dtype), STEPS):
            feeds = {"x": x, "starts": np.array([start], np_dtype), "ends": np.array([end], np_dtype),
                     "steps": np.array([step], np_dtype)}
            got = session.run(["y"], feeds)[0]
            assert got.tolist() == list(slice_range(dim, start, end, step)), (dim, start, end, step)
            checked += 1
    assert checked > 3000


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fed_and_constant_ends_agree_on_both_runtimes(dtype):
    np_dtype = DTYPES[dtype]
    fed = _fed_graph(dtype)
    cases = list(itertools.product((2, -1, INT32_MIN, INT32_MAX) + ((INT64_MAX,) if np_dtype is np.int64 else ()),
                                   (INT32_MAX, -1) + ((INT64_MAX, INT64_MIN) if np_dtype is np.int64 else ()), STEPS))
    b = geir.GraphBuilder(f"constant_slices_{dtype}")
    x = b.input("x", "float32", (3,))
    for i, (start, end, step) in enumerate(cases):
        ints = [b.constant(f"{k}{i}", np.array([v], np_dtype)) for k, v in (("s", start), ("e", end), ("k", step))]
        b.output(b.op("Slice", x, *ints[:2], None, ints[2]), f"y{i}")
    constant = b.build()
    x = np.arange(3, dtype=np.float32)
    for runtime in ("numpy", "onnxruntime"):
        results = geir.run(constant, {"x": x}, runtime=runtime)
        for i, (start, end, step) in enumerate(cases):
            want = list(slice_range(3, start, end, step))
            assert results[f"y{i}"].tolist() == want, (runtime, start, end, step)
            feeds = {"x": x, "starts": np.array([start], np_dtype), "ends": np.array([end], np_dtype),
                     "steps": np.array([step], np_dtype)}
            assert geir.run(fed, feeds, runtime=runtime)["y"].tolist() == want, (runtime, "fed", start, end, step)


def _plain_slice_model(dtype: int) -> object:
    """Slice with fed operands as ONNX writes it, no geir in the loop."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])] + [
        helper.make_tensor_value_info(name, dtype, [1]) for name in ("starts", "ends", "steps")]
    node = helper.make_node("Slice", ["x", "starts", "ends", "", "steps"], ["y"])
    graph = helper.make_graph([node], "plain", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", geir.schemas.OPSET)])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_canonical_ends_mean_the_same_to_onnx_reference(dtype):
    """onnx.reference reads the exported model (with its Where) as it reads the plain Slice, sentinels included.
    (Where onnx.reference itself departs from the spec -- it uses Python's slice rules for a start or end below -dim
    under a negative step -- both models depart alike; the spec's positions are checked on ONNX Runtime above.)"""
    np_dtype = DTYPES[dtype]
    ours = ReferenceEvaluator(geir.to_onnx(_fed_graph(dtype)))
    plain = ReferenceEvaluator(_plain_slice_model(TensorProto.INT64 if np_dtype is np.int64 else TensorProto.INT32))
    extremes = [INT32_MIN, INT32_MAX] + ([INT64_MIN, INT64_MAX] if np_dtype is np.int64 else [])
    for dim in (0, 1, 3):
        x = np.arange(dim, dtype=np.float32)
        starts, ends = [-1, 0, dim - 1, dim] + extremes, [-1, 0, dim] + extremes
        for start, end, step in itertools.product(starts, ends, (-2, -1, 1)):
            feeds = {"x": x, "starts": np.array([start], np_dtype), "ends": np.array([end], np_dtype),
                     "steps": np.array([step], np_dtype)}
            assert ours.run(None, feeds)[0].tolist() == plain.run(None, feeds)[0].tolist(), (dim, start, end, step)


def test_only_the_ends_onnxruntime_misreads_are_rewritten():
    """Constant ends without a sentinel, or positive constant steps, export as they are; a rewritten end is a new
    initializer (the graph's constant, which other nodes may read, is kept)."""
    b = geir.GraphBuilder("rewrites")
    x = b.input("x", "float32", (4,))
    ints = {name: b.constant(name, np.array(v, np.int64)) for name, v in (
        ("s", [3]), ("e_max", [INT64_MAX]), ("e_small", [0]), ("up", [1]), ("down", [-1]))}
    b.output(b.op("Slice", x, ints["s"], ints["e_max"], None, ints["down"]), "backward_max")
    b.output(b.op("Slice", x, ints["s"], ints["e_small"], None, ints["down"]), "backward_small")
    b.output(b.op("Slice", x, ints["s"], ints["e_max"], None, ints["up"]), "forward_max")
    model = geir.to_onnx(b.build())
    ends = {node.output[0]: node.input[2] for node in model.graph.node}
    assert ends["backward_small"] == "e_small" and ends["forward_max"] == "e_max"
    assert ends["backward_max"] not in ("e_max", "e_small")
    values = {t.name: t for t in model.graph.initializer}
    assert "e_max" in values and list(values[ends["backward_max"]].int64_data or
                                      np.frombuffer(values[ends["backward_max"]].raw_data, np.int64)) == [-1]
