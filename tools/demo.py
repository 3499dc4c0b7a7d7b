"""``geir demo``: build the spec's graph-mode examples, run them, compare with the expected values.

Expected values are the spec's worked examples (exact decimals). Cases in float16/bfloat16
feed the same decimals rounded to that dtype, so their tolerance is the input rounding's
effect: a few units of the dtype's precision times the size of the terms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import geir

from ._table import format_table

ROPE, ROPE_GRAD = "InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
"""Max abs error allowed for results of magnitude <= 16 computed from rounded inputs."""


@dataclass
class DemoCase:
    name: str
    op: str
    dtype: str
    build: Callable[[], tuple[geir.Graph, dict[str, np.ndarray]]]
    expected: np.ndarray

    def run(self, runtime: str = "numpy") -> tuple[float, bool]:
        graph, feeds = self.build()
        snapshot = {k: v.copy() for k, v in feeds.items()}
        (result,) = geir.run(graph, feeds, runtime=runtime).values()
        unchanged = all(np.array_equal(snapshot[k], feeds[k]) for k in feeds)
        error = float(np.max(np.abs(result.astype(np.float64) - self.expected))) if result.size else 0.0
        return error, unchanged and result.shape == self.expected.shape and error <= TOLERANCE[self.dtype]


def _rotary_graph(op: str, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dtype: str, cos_dtype: str,
                  **attrs: object) -> Callable[[], tuple[geir.Graph, dict[str, np.ndarray]]]:
    def build() -> tuple[geir.Graph, dict[str, np.ndarray]]:
        b = geir.GraphBuilder(op.lower())
        feeds = {"x": x.astype(geir.as_dtype(dtype).numpy), "cos": cos.astype(geir.as_dtype(cos_dtype).numpy),
                 "sin": sin.astype(geir.as_dtype(cos_dtype).numpy)}
        values = [b.input(name, arr.dtype, arr.shape) for name, arr in feeds.items()]
        b.output(getattr(b, op)(*values, **attrs), "y")
        return b.build(), feeds
    return build


def _roundtrip_graph(dtype: str) -> Callable[[], tuple[geir.Graph, dict[str, np.ndarray]]]:
    """Forward then grad in one graph: with pair-duplicated tables on the unit circle, grad(fwd(x)) == x."""
    def build() -> tuple[geir.Graph, dict[str, np.ndarray]]:
        angle = np.linspace(0.1, 1.4, 32)
        theta = np.concatenate([angle, angle]).reshape(1, 1, 1, 64)
        np_dt = geir.as_dtype(dtype).numpy
        feeds = {"x": np.tile(np.linspace(-4, 4, 64), (2, 3, 4, 1)).astype(np_dt),
                 "cos": np.cos(theta).astype(np.float32), "sin": np.sin(theta).astype(np.float32)}
        b = geir.GraphBuilder("rope_roundtrip")
        x, cos, sin = (b.input(k, v.dtype, v.shape) for k, v in feeds.items())
        y = b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=0, partial_slice=[0, 64])
        cos_g = b.input("cos_g", np_dt, (1, 1, 1, 64))
        sin_g = b.input("sin_g", np_dt, (1, 1, 1, 64))
        feeds["cos_g"], feeds["sin_g"] = feeds["cos"].astype(np_dt), feeds["sin"].astype(np_dt)
        b.output(b.InplacePartialRotaryMulGrad(y, cos_g, sin_g, rotary_mode=0, partial_slice=[0, 64]), "x_back")
        return b.build(), feeds
    return build


def rotary_cases() -> list[DemoCase]:
    cases: list[DemoCase] = []
    ones = np.ones((1, 1, 1, 128))
    cases.append(DemoCase("GE IR example (E3)", ROPE_GRAD, "float32",
                          _rotary_graph(ROPE_GRAD, 2 * ones, ones, 0 * ones, "float32", "float32",
                                        rotary_mode=1, partial_slice=[0, 128]), 2 * ones))
    dy = np.tile(np.arange(1.0, 9.0), (2, 2, 2, 1))
    cos = np.tile([0.5, 0.6, 0.7, 0.8], (1, 2, 1, 1))
    sin = np.tile([0.1, 0.2, 0.3, 0.4], (1, 2, 1, 1))
    e1 = {  # spec 2.5 E1: mode -> (grad row, forward row)
        0: ([1, 2, 3, 4.8, 3.2, 4, 7, 8], [1, 2, 1, 1.2, 4.4, 6.4, 7, 8]),
        1: ([1, 2, 2.3, 2.1, 5.9, 3.3, 7, 8], [1, 2, 1.1, 3, 1.7, 6.8, 7, 8]),
        2: ([1, 2, 2.3, 2.1, 5.9, 3.3, 7, 8], [1, 2, 1.1, 3, 1.7, 6.8, 7, 8]),
        3: ([1, 2, 3, 3.2, 4.8, 4, 7, 8], [1, 2, 1.1, 1.8, 3.7, 6.8, 7, 8]),
    }
    for mode, (grad_row, fwd_row) in e1.items():
        for op, row in ((ROPE_GRAD, grad_row), (ROPE, fwd_row)):
            label = "CANN example (2,2,2,8)" if mode == 1 and op == ROPE_GRAD else "E1 (2,2,2,8)"
            cases.append(DemoCase(f"{label} mode {mode}", op, "float32",
                                  _rotary_graph(op, dy, cos, sin, "float32", "float32", rotary_mode=mode,
                                                partial_slice=[2, 6]), np.tile(row, (2, 2, 2, 1))))
    x = np.arange(1.0, 9.0).reshape(1, 1, 1, 8)
    c = np.arange(1, 9).reshape(1, 1, 1, 8) / 10
    s = c[..., ::-1].copy()
    e2 = {  # spec 2.5 E2
        0: ([2.1, 2.2, 2.3, 2.4, 1.7, 2.2, 3.1, 4.4], [-3.9, -3.8, -3.3, -2.4, 2.9, 4.2, 5.5, 6.8]),
        1: ([1.5, -0.4, 2.9, -0.2, 4.3, 1.6, 5.7, 5.0], [-1.5, 1.1, -1.5, 3.1, 0.1, 5.1, 3.3, 7.1]),
        2: ([1.9, 2.4, 0.1, 0.2, 3.9, 4.4, 2.9, 4.6], [-2.3, -2.4, 1.5, 2.6, -0.3, 1.2, 5.9, 7.0]),
        3: ([2.1, 1.7, 2.2, 2.2, 2.3, 3.1, 2.4, 4.4], [-1.5, -2.2, -2.1, -1.2, 1.4, 3.3, 5.2, 7.1]),
    }
    for mode, (grad_row, fwd_row) in e2.items():
        for dtype in ("float32", "float16", "bfloat16"):
            for op, row in ((ROPE_GRAD, grad_row), (ROPE, fwd_row)):
                cases.append(DemoCase(f"E2 mode {mode}", op, dtype,
                                      _rotary_graph(op, x, c, s, dtype, dtype, rotary_mode=mode,
                                                    partial_slice=[0, 8]), np.reshape(row, (1, 1, 1, 8))))
    cases.append(DemoCase("E4 default attributes (identity)", ROPE_GRAD, "float16",
                          _rotary_graph(ROPE_GRAD, dy, cos, sin, "float16", "float16"), dy))
    for dtype in ("float32", "bfloat16"):
        build = _roundtrip_graph(dtype)
        cases.append(DemoCase("forward -> grad in one graph", f"{ROPE} + Grad", dtype, build,
                              build()[1]["x"].astype(np.float64)))
    return cases


def run_demo(runtime: str = "numpy") -> int:
    """Print the demo table; return the number of failed cases."""
    rows, failed = [], 0
    for case in rotary_cases():
        error, ok = case.run(runtime)
        failed += not ok
        rows.append((case.name, case.op, case.dtype, f"{error:.3g}", f"{TOLERANCE[case.dtype]:g}",
                     "pass" if ok else "FAIL"))
    print(f"geir demo: rotary graph-mode examples on the {runtime} runtime\n")
    print(format_table(("case", "op", "dtype", "max error", "tolerance", "result"), rows))
    print(f"\n{len(rows) - failed}/{len(rows)} cases passed")
    return failed
