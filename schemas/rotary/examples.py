"""The rotary ops' example cases: the worked examples (spec 2.5, exact decimal values) and
``RotaryCase``, random inputs of a shape, whose ``BENCH`` instances ``geir bench`` measures."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ir._dtypes import as_dtype
from .._examples import Example, register_examples
from .schema import FORWARD, GRAD

E1_ROWS = {  # mode -> (grad row, forward row); dy rows [1..8], cos [0.5..0.8], sin [0.1..0.4], slice [2, 6)
    0: ([1, 2, 3, 4.8, 3.2, 4, 7, 8], [1, 2, 1, 1.2, 4.4, 6.4, 7, 8]),
    1: ([1, 2, 2.3, 2.1, 5.9, 3.3, 7, 8], [1, 2, 1.1, 3, 1.7, 6.8, 7, 8]),
    2: ([1, 2, 2.3, 2.1, 5.9, 3.3, 7, 8], [1, 2, 1.1, 3, 1.7, 6.8, 7, 8]),
    3: ([1, 2, 3, 3.2, 4.8, 4, 7, 8], [1, 2, 1.1, 1.8, 3.7, 6.8, 7, 8]),
}
E2_ROWS = {  # mode -> (grad, forward); x [1..8], cos [0.1..0.8], sin reversed, slice [0, 8)
    0: ([2.1, 2.2, 2.3, 2.4, 1.7, 2.2, 3.1, 4.4], [-3.9, -3.8, -3.3, -2.4, 2.9, 4.2, 5.5, 6.8]),
    1: ([1.5, -0.4, 2.9, -0.2, 4.3, 1.6, 5.7, 5.0], [-1.5, 1.1, -1.5, 3.1, 0.1, 5.1, 3.3, 7.1]),
    2: ([1.9, 2.4, 0.1, 0.2, 3.9, 4.4, 2.9, 4.6], [-2.3, -2.4, 1.5, 2.6, -0.3, 1.2, 5.9, 7.0]),
    3: ([2.1, 1.7, 2.2, 2.2, 2.3, 3.1, 2.4, 4.4], [-1.5, -2.2, -2.1, -1.2, 1.4, 3.3, 5.2, 7.1]),
}
E1_DY = np.tile(np.arange(1.0, 9.0), (2, 2, 2, 1))
E1_COS = np.tile([0.5, 0.6, 0.7, 0.8], (1, 2, 1, 1))
E1_SIN = np.tile([0.1, 0.2, 0.3, 0.4], (1, 2, 1, 1))
E2_X = np.arange(1.0, 9.0).reshape(1, 1, 1, 8)
E2_COS = np.arange(1, 9).reshape(1, 1, 1, 8) / 10
E2_SIN = E2_COS[..., ::-1].copy()


def _examples() -> list[Example]:
    ones = np.ones((1, 1, 1, 128))
    found = [Example("GE IR example (E3)", GRAD, {"dy": 2 * ones, "cos": ones, "sin": 0 * ones},
                     {"rotary_mode": 1, "partial_slice": (0, 128)}, {"dy": 2 * ones})]
    for mode, (grad_row, fwd_row) in E1_ROWS.items():
        for schema, tensor, row in ((GRAD, "dy", grad_row), (FORWARD, "x", fwd_row)):
            label = "CANN example (2,2,2,8)" if mode == 1 and schema is GRAD else "E1 (2,2,2,8)"
            found.append(Example(f"{label} mode {mode}", schema, {tensor: E1_DY, "cos": E1_COS, "sin": E1_SIN},
                                 {"rotary_mode": mode, "partial_slice": (2, 6)},
                                 {tensor: np.tile(row, (2, 2, 2, 1))}))
    for mode, (grad_row, fwd_row) in E2_ROWS.items():
        for schema, tensor, row in ((GRAD, "dy", grad_row), (FORWARD, "x", fwd_row)):
            found.append(Example(f"E2 mode {mode}", schema, {tensor: E2_X, "cos": E2_COS, "sin": E2_SIN},
                                 {"rotary_mode": mode, "partial_slice": (0, 8)},
                                 {tensor: np.reshape(row, (1, 1, 1, 8))}, dtypes=("float32", "float16", "bfloat16")))
    found.append(Example("E4 default attributes (identity)", GRAD, {"dy": E1_DY, "cos": E1_COS, "sin": E1_SIN}, {},
                         {"dy": E1_DY}, dtypes=("float16",), warning="RP-W1"))
    return found


register_examples(*_examples())


@dataclass(frozen=True)
class RotaryCase:
    """Standard-normal ``x``, ``cos``, ``sin`` for a slice of ``x`` of ``shape`` (tables (1, S, 1, L))."""

    shape: tuple[int, int, int, int]
    partial_slice: tuple[int, int]
    dtype: str = "float32"
    rotary_mode: int = 1
    seed: int = 0

    def arrays(self, cos_dtype: str | None = None) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        table = (1, self.shape[1], 1, self.partial_slice[1] - self.partial_slice[0])
        dt, ct = as_dtype(self.dtype).numpy, as_dtype(cos_dtype or self.dtype).numpy
        return {"x": rng.standard_normal(self.shape, np.float32).astype(dt),
                "cos": rng.standard_normal(table, np.float32).astype(ct),
                "sin": rng.standard_normal(table, np.float32).astype(ct)}

    def attributes(self) -> dict:
        return {"rotary_mode": self.rotary_mode, "partial_slice": list(self.partial_slice)}


BENCH = {"bench": (RotaryCase((4, 2048, 32, 128), (0, 128)), RotaryCase((1, 4096, 128, 192), (128, 192), "bfloat16")),
         "quick": (RotaryCase((1, 64, 32, 128), (0, 128)), RotaryCase((1, 64, 128, 192), (128, 192), "bfloat16"))}
"""Benchmark shapes of ``geir bench`` (full and ``--quick``): a whole-axis float32 slice, a bfloat16 tail slice."""
