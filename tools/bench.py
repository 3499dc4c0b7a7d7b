"""``geir bench``: time the runtimes against the machine's copy bandwidth and a naive NumPy formula.

All timings of one table come from one run (best of ``repeat``), so ratios are meaningful
even on a shared machine whose absolute speed drifts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import geir
from geir.runtimes import get_runtime

from ._table import format_table


def best_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up: page in buffers, first-call costs
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class RotaryBenchCase:
    label: str
    dtype: str
    shape: tuple[int, int, int, int]
    partial_slice: tuple[int, int]

    def arrays(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        np_dt = geir.as_dtype(self.dtype).numpy
        length = self.partial_slice[1] - self.partial_slice[0]
        table = (1, self.shape[1], 1, length)
        return {"dy": rng.standard_normal(self.shape, np.float32).astype(np_dt),
                "cos": rng.standard_normal(table, np.float32).astype(np_dt),
                "sin": rng.standard_normal(table, np.float32).astype(np_dt)}


def naive_rotary_grad(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray, start: int, end: int) -> np.ndarray:
    """The spec's formula for mode 1 written the obvious NumPy way (full-size temporaries)."""
    out = dy.copy()
    g = dy[..., start:end].astype(np.float32)
    c = cos.astype(np.float32)
    n = sin.astype(np.float32)
    y = np.empty_like(g)
    y[..., 0::2] = c[..., 0::2] * g[..., 0::2] + n[..., 1::2] * g[..., 1::2]
    y[..., 1::2] = c[..., 1::2] * g[..., 1::2] - n[..., 0::2] * g[..., 0::2]
    out[..., start:end] = y.astype(dy.dtype)
    return out


def bench_rotary(quick: bool = False, repeat: int = 5) -> str:
    cases = [RotaryBenchCase("full slice", "float32", (4, 2048, 32, 128), (0, 128)),
             RotaryBenchCase("slice [128,192)", "bfloat16", (1, 4096, 128, 192), (128, 192))]
    if quick:
        cases = [RotaryBenchCase(c.label, c.dtype, (1, 64, c.shape[2], c.shape[3]), c.partial_slice) for c in cases]
    rows = []
    for case in cases:
        feeds = case.arrays()
        dy = feeds["dy"]
        b = geir.GraphBuilder("rope_grad_bench")
        inputs = [b.input(k, v.dtype, v.shape) for k, v in feeds.items()]
        b.output(b.InplacePartialRotaryMulGrad(*inputs, rotary_mode=1, partial_slice=list(case.partial_slice)), "dx")
        executable = get_runtime("numpy").compile(b.build())
        dst = np.empty_like(dy)
        moved = 2 * dy.nbytes  # read dy, write dx
        t_copy = best_time(lambda: np.copyto(dst, dy), repeat)
        t_geir = best_time(lambda: executable.run(feeds), repeat)
        t_naive = best_time(lambda: naive_rotary_grad(dy, feeds["cos"], feeds["sin"], *case.partial_slice), repeat)
        for name, t in (("np.copyto(dy)", t_copy), ("geir numpy runtime", t_geir), ("naive NumPy formula", t_naive)):
            rows.append((f"{list(case.shape)} {case.dtype} {case.label}", name, f"{t * 1e3:.2f}",
                         f"{moved / t / 1e9:.2f}", f"{t / t_copy:.2f}x"))
    title = "InplacePartialRotaryMulGrad, mode 1 (bytes moved = read dy + write dx; target: geir <= 4x copy)"
    return title + "\n" + format_table(("case", "implementation", "ms", "effective GB/s", "vs copy"), rows)


BENCHES: dict[str, Callable[..., str]] = {"rotary": bench_rotary}
