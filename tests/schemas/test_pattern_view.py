"""GraphView, what fusion matchers read the graph through: shape computations fold only where the result is exactly
what the runtimes compute (static dims, no overflow), and constant bounds pass through as they are."""

from __future__ import annotations

import numpy as np

import geir
from geir.schemas.patterns import GraphView


def _value(build):
    b = geir.GraphBuilder("view")
    x = b.input("x", "float32", ("n", 8))
    result = build(b, x)
    b.output(b.op("Identity", x), "y")
    graph = b.build()
    return GraphView(graph), result


def test_a_shape_computation_folds_over_static_dims_only():
    view, half = _value(lambda b, x: b.op("Div", b.op("Gather", b.op("Shape", x), b.constant("i", np.array([1]))),
                                          b.constant("two", np.array([2]))))
    assert view.folded(half).tolist() == [4]
    view, rows = _value(lambda b, x: b.op("Gather", b.op("Shape", x), b.constant("i", np.array([0]))))
    assert view.folded(rows) is None                  # the symbolic dim n


def test_integer_division_truncates_and_overflow_is_not_folded():
    view, quotient = _value(lambda b, x: b.op("Div", b.constant("a", np.array([-7, 7])),
                                              b.constant("b", np.array([2, -2]))))
    assert view.folded(quotient).tolist() == [-3, -3]                    # toward zero, as ONNX Runtime
    view, total = _value(lambda b, x: b.op("Add", b.constant("a", np.array([2 ** 63 - 1])),
                                           b.constant("b", np.array([1]))))
    assert view.folded(total) is None
    view, zero = _value(lambda b, x: b.op("Div", b.constant("a", np.array([1])), b.constant("b", np.array([0]))))
    assert view.folded(zero) is None


def test_a_constant_int64_min_bound_is_a_bound_not_a_symbol():
    view, bound = _value(lambda b, x: b.constant("end", np.array([-2 ** 63])))
    assert view.folded(bound).tolist() == [-2 ** 63]


def test_a_mask_computed_from_constants_is_evaluated_as_the_runtimes_compute_it():
    """A causal mask exporters leave unfolded: Where(And(rows >= cols, keep), 0, -inf) over constants."""
    rows, cols = np.arange(4)[:, None], np.arange(4)[None, :]

    def mask(b, x):
        lower = b.op("GreaterOrEqual", b.constant("rows", rows), b.constant("cols", cols))
        keep = b.op("And", lower, b.op("Not", b.constant("drop", np.zeros((1, 4), bool))))
        return b.op("Where", keep, b.constant("zero", np.array(0.0, np.float32)),
                    b.constant("minus_inf", np.array(-np.inf, np.float32)))
    view, value = _value(mask)
    want = np.where(rows >= cols, 0.0, -np.inf).astype(np.float32)
    got = view.evaluated(value)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    for runtime in ("numpy", "onnxruntime"):                   # what the graph computes when it runs
        b = geir.GraphBuilder("mask")
        b.output(mask(b, None), "m")
        np.testing.assert_array_equal(geir.run(b.build(), {}, runtime=runtime)["m"], want)
    view, fed = _value(lambda b, x: b.op("Less", x, b.constant("zero", np.array(0.0, np.float32))))
    assert view.evaluated(fed) is None                          # reads the input
    view, other = _value(lambda b, x: b.op("Add", b.constant("a", np.ones(2, np.float32)),
                                           b.constant("b", np.ones(2, np.float32))))
    assert view.evaluated(other) is None                        # not an op it evaluates


def test_a_mask_asked_for_twice_in_a_row_is_evaluated_once(monkeypatch):
    """A matcher reads the causal mask where it finds it and again where it classifies it: one evaluation (of up to
    2**24 elements), and only the last mask is kept."""
    from geir.schemas import patterns

    calls = []
    real = patterns._ELEMENTWISE["Not"]
    monkeypatch.setitem(patterns._ELEMENTWISE, "Not", lambda a: calls.append(1) or real(a))
    b = geir.GraphBuilder("view")
    b.input("x", "float32", (1,))
    first = b.op("Not", b.constant("a", np.eye(3, dtype=bool)))
    second = b.op("Not", b.constant("b", np.eye(2, dtype=bool)))
    b.output(first, "f")
    b.output(second, "s")
    view = GraphView(b.build())
    assert np.array_equal(view.evaluated(first), ~np.eye(3, dtype=bool))
    assert view.evaluated(first) is view.evaluated(first) and len(calls) == 1
    assert np.array_equal(view.evaluated(second), ~np.eye(2, dtype=bool)) and len(calls) == 2
    view.evaluated(first)
    assert len(calls) == 3                                       # the one entry now holds the second mask's
