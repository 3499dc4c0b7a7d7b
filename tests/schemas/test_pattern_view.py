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
