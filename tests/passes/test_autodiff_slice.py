"""Slice has one meaning, ONNX's, everywhere (issue 23 items 5 and 6): the NumPy runtime, the float64 reference and the
VJP against ONNX Runtime, over a table of starts and ends that includes INT64's sentinels and negative steps."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import geir
from geir.schemas.onnx_slice import SliceError, slice_index, slice_range
from geir.testing import reference

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
BOUNDS = (INT64_MIN, -2 ** 62, -6, -1, 0, 2, 5, INT64_MAX)
STEPS = (-3, -1, 1, 2)


def _slices_graph(dim: int, cases: list[tuple[int, int, int]]) -> geir.Graph:
    """One Slice node per (start, end, step) of ``x`` (dim,), each its own output."""
    b = geir.GraphBuilder(f"slices_{dim}")
    x = b.input("x", "float32", (dim,))
    axis = b.constant("axis", np.array([0], np.int64))
    for i, (start, end, step) in enumerate(cases):
        ints = [b.constant(f"{k}{i}", np.array([v], np.int64)) for k, v in (("s", start), ("e", end), ("k", step))]
        b.output(b.op("Slice", x, ints[0], ints[1], axis, ints[2]), f"y{i}")
    return b.build()


def test_the_issue_case_selects_x0_everywhere_and_its_gradient_flows_there():
    graph = _slices_graph(4, [(-6, -2 ** 62, -1)])
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    for result in (geir.run(graph, {"x": x}, runtime="numpy"), geir.run(graph, {"x": x}, runtime="onnxruntime"),
                   reference(graph, {"x": x})):
        np.testing.assert_array_equal(result["y0"], [1.0])
    derivative = geir.grad(graph)
    feeds = {"x": x, "grad_y0": np.array([2.5], np.float32)}
    for runtime in ("numpy", "onnxruntime"):
        np.testing.assert_array_equal(geir.run(derivative, feeds, runtime=runtime)["grad_x"], [2.5, 0, 0, 0])
    np.testing.assert_array_equal(reference(derivative, feeds)["grad_x"], [2.5, 0, 0, 0])


@pytest.mark.parametrize("dim", [0, 1, 4])
def test_numpy_reference_and_vjp_read_what_onnx_reads(dim):
    """x = arange(dim): an output names the positions its Slice read, in order. The NumPy runtime and the reference
    must read what ONNX Runtime reads (the export canonicalises the ends ONNX Runtime reads otherwise than the spec) in
    the length onnx's shape inference declared, and the VJP must place each cotangent element at the position it was
    read from."""
    cases = list(itertools.product(BOUNDS, BOUNDS, STEPS))
    graph = _slices_graph(dim, cases)
    x = np.arange(dim, dtype=np.float32)
    onnxruntime = geir.run(graph, {"x": x}, runtime="onnxruntime")
    numpy = geir.run(graph, {"x": x}, runtime="numpy")
    golden = reference(graph, {"x": x})
    derivative = geir.grad(graph)
    rng = np.random.default_rng(dim)
    cotangents = {f"grad_{v.name}": rng.integers(1, 9, v.type.shape).astype(np.float32) for v in graph.outputs}
    grads = reference(derivative, {"x": x, **cotangents}, rounded=False)
    expected = np.zeros(dim)
    for i, (start, end, step) in enumerate(cases):
        read = numpy[f"y{i}"]
        where = f"dim {dim}, start {start}, end {end}, step {step}"
        assert read.shape == tuple(graph.outputs[i].type.shape), where
        np.testing.assert_array_equal(golden[f"y{i}"], read, err_msg=where)
        np.testing.assert_array_equal(onnxruntime[f"y{i}"], read, err_msg=where)
        assert list(slice_range(dim, start, end, step)) == read.astype(int).tolist(), where
        np.add.at(expected, read.astype(int), cotangents[f"grad_y{i}"])
    # each cotangent element (a random integer) lands where its element was read; all slices share x
    np.testing.assert_array_equal(grads["grad_x"], expected)
    assert dim == 0 or expected.any()


def test_onnx_runtime_reads_an_int64_max_end_with_a_negative_step_as_the_spec_does():
    graph = _slices_graph(3, [(2, INT64_MAX, -1)])
    assert graph.outputs[0].type.shape == (0,)
    x = np.arange(3, dtype=np.float32)
    assert geir.run(graph, {"x": x}, runtime="numpy")["y0"].shape == (0,)
    assert geir.run(graph, {"x": x}, runtime="onnxruntime")["y0"].shape == (0,)


def test_slice_operands_onnx_does_not_define_are_errors_naming_the_operand():
    with pytest.raises(SliceError, match=r"steps: expected a non-zero step, got 0 \(axis 1, entry 0\)"):
        slice_index((2, 3), [0], [3], [1], [0])
    with pytest.raises(SliceError, match=r"axes\[1\]: expected distinct axes, got axis 0 twice"):
        slice_index((2, 3), [0, 0], [1, 1], [0, -2])
    with pytest.raises(SliceError, match=r"axes\[0\]: expected an axis in \[-2, 1\], got 2"):
        slice_index((2, 3), [0], [1], [2])
    with pytest.raises(SliceError, match=r"ends: expected 2 values \(one per entry of starts\), got 1"):
        slice_index((2, 3), [0, 0], [1])
    b = geir.GraphBuilder("fed_steps")
    x = b.input("x", "float32", (2, 3))
    steps = b.input("steps", "int64", (1,))
    b.output(b.op("Slice", x, b.constant("s", np.array([0], np.int64)), b.constant("e", np.array([3], np.int64)),
                  b.constant("a", np.array([1], np.int64)), steps), "y")
    graph = b.build()
    with pytest.raises(geir.ExecutionError, match=r"Slice 'Slice_0'.*steps: expected a non-zero step, got 0"):
        geir.run(graph, {"x": np.zeros((2, 3), np.float32), "steps": np.array([0], np.int64)}, runtime="numpy")
    with pytest.raises(geir.ExecutionError, match=r"steps: expected a non-zero step, got 0"):
        reference(graph, {"x": np.zeros((2, 3), np.float32), "steps": np.array([0], np.int64)})
