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
from geir.moe_indices import sorted_indices_from_expert_ids
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


def _memory_bound_rows(label: str, moved: int, timings: list[tuple[str, Callable[[], object]]],
                       repeat: int) -> list[tuple[str, ...]]:
    """Time each implementation; ratios are to the first (the copy of the same bytes)."""
    times = [(name, best_time(fn, repeat)) for name, fn in timings]
    t_copy = times[0][1]
    return [(label, name, f"{t * 1e3:.2f}", f"{moved / t / 1e9:.2f}", f"{t / t_copy:.2f}x") for name, t in times]


def _compile_one_node(name: str, op: str, feeds: dict[str, np.ndarray], outputs: tuple[str, ...], **attrs):
    b = geir.GraphBuilder(name)
    inputs = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items()}   # feeds are keyed by input name
    results = getattr(b, op)(**inputs, **attrs)
    for value, out_name in zip(results if isinstance(results, tuple) else (results,), outputs):
        b.output(value, out_name)
    return get_runtime("numpy").compile(b.build())


HEADERS = ("case", "implementation", "ms", "effective GB/s", "vs copy")


def bench_rotary(quick: bool = False, repeat: int = 5) -> str:
    cases = [RotaryBenchCase("full slice", "float32", (4, 2048, 32, 128), (0, 128)),
             RotaryBenchCase("slice [128,192)", "bfloat16", (1, 4096, 128, 192), (128, 192))]
    if quick:
        cases = [RotaryBenchCase(c.label, c.dtype, (1, 64, c.shape[2], c.shape[3]), c.partial_slice) for c in cases]
    rows = []
    for case in cases:
        feeds = case.arrays()
        dy = feeds["dy"]
        executable = _compile_one_node("rope_grad_bench", "InplacePartialRotaryMulGrad", feeds, ("dx",),
                                       rotary_mode=1, partial_slice=list(case.partial_slice))
        dst = np.empty_like(dy)
        rows += _memory_bound_rows(f"{list(case.shape)} {case.dtype} {case.label}", 2 * dy.nbytes, [
            ("np.copyto(dy)", lambda: np.copyto(dst, dy)),
            ("geir numpy runtime", lambda: executable.run(feeds)),
            ("naive NumPy formula", lambda: naive_rotary_grad(dy, feeds["cos"], feeds["sin"], *case.partial_slice)),
        ], repeat)
    title = "InplacePartialRotaryMulGrad, mode 1 (bytes moved = read dy + write dx; target: geir <= 4x copy)"
    return title + "\n" + format_table(HEADERS, rows)


def naive_moe_grad(tokens: np.ndarray, grad: np.ndarray, indices: np.ndarray, probs: np.ndarray):
    """The spec's formula written the obvious NumPy way (full-size float32 temporaries)."""
    n, topk = probs.shape
    out = np.empty((indices.size, grad.shape[1]), grad.dtype)
    out[indices] = (grad.astype(np.float32)[:, None, :] * probs.astype(np.float32)[:, :, None]).reshape(
        indices.size, -1).astype(grad.dtype)
    pg = (tokens.astype(np.float32)[indices.reshape(n, topk)] * grad.astype(np.float32)[:, None, :]).sum(-1)
    return out, pg.astype(probs.dtype)


EXPERTS = 64


def bench_moe(quick: bool = False, repeat: int = 5) -> str:
    """Grad with probs on realistic routing: sorted_indices from a stable sort of random top-K expert ids.

    Two copy baselines: into a reused buffer (pure bandwidth) and into a fresh one (what any op
    that returns a new output also pays: the kernel zeroes and maps its pages on first touch).
    """
    tokens, topk, hidden = (512, 8, 256) if quick else (8192, 8, 1024)
    rows = []
    for dtype in ("float32", "bfloat16"):
        rng = np.random.default_rng(0)
        np_dt = geir.as_dtype(dtype).numpy
        experts = np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :topk]  # top-K routing, distinct experts
        feeds = {"permuted_tokens": rng.standard_normal((tokens * topk, hidden), np.float32).astype(np_dt),
                 "unpermuted_tokens_grad": rng.standard_normal((tokens, hidden), np.float32).astype(np_dt),
                 "sorted_indices": sorted_indices_from_expert_ids(experts),
                 "probs": rng.uniform(0, 1, (tokens, topk)).astype(np_dt)}
        executable = _compile_one_node("moe_grad_bench", "MoeTokenUnpermuteGrad", feeds,
                                       ("permuted_tokens_grad", "probs_grad"))
        moved = 2 * feeds["permuted_tokens"].nbytes + feeds["unpermuted_tokens_grad"].nbytes
        src = np.empty(moved // 2, np.uint8)
        src[:] = 1
        dst = np.empty_like(src)
        rows += _memory_bound_rows(f"T={tokens} K={topk} H={hidden} {dtype}", moved, [
            ("np.copyto of the same bytes", lambda: np.copyto(dst, src)),
            ("same, into a fresh buffer", lambda: np.copyto(np.empty_like(src), src)),
            ("geir numpy runtime", lambda: executable.run(feeds)),
            ("naive NumPy formula", lambda: naive_moe_grad(*feeds.values())),
        ], repeat)
    title = ("MoeTokenUnpermuteGrad with probs (bytes moved = read permuted_tokens and dY, write "
             "permuted_tokens_grad; target: geir <= 3x copy)")
    return title + "\n" + format_table(HEADERS, rows)


def sfa_bench_feeds(batch: int, seq_q: int, seq_kv: int, heads: int, topk: int, d: int, dr: int,
                    dtype: str = "float16") -> dict[str, np.ndarray]:
    """BSND inputs with ``topk`` distinct random keys per query row (sparse_mode 0: all of them count)."""
    rng = np.random.default_rng(0)
    np_dt = geir.as_dtype(dtype).numpy
    normal = lambda *shape: rng.standard_normal(shape, np.float32).astype(np_dt)  # noqa: E731
    indices = np.argsort(rng.random((batch * seq_q, seq_kv)), axis=1)[:, :topk].astype(np.int32)
    return {"query": normal(batch, seq_q, heads, d), "key": normal(batch, seq_kv, 1, d),
            "value": normal(batch, seq_kv, 1, d), "sparse_indices": indices.reshape(batch, seq_q, 1, topk),
            "query_rope": normal(batch, seq_q, heads, dr), "key_rope": normal(batch, seq_kv, 1, dr)}


def bench_sfa(quick: bool = False, repeat: int = 3) -> str:
    """SparseFlashAttentionGrad at the issue's shape; GFLOP/s against a float32 matmul of comparable size.

    FLOPs count only selected keys: 2 * Ksel * (3 * Dqk + 2 * Dv) per query token and head.
    """
    batch, seq_q, seq_kv, heads, topk, d, dr = (1, 64, 512, 16, 64, 128, 64) if quick else (1, 512, 2048, 16, 256, 128, 64)
    feeds = sfa_bench_feeds(batch, seq_q, seq_kv, heads, topk, d, dr)
    scale = float(np.float32(1 / np.sqrt(d + dr)))
    forward = _compile_one_node("sfa_fwd", "SparseFlashAttention", feeds, ("out", "softmax_max", "softmax_sum"),
                                scale_value=scale, sparse_mode=0, return_softmax_lse=True)
    out = forward.run(feeds)
    grad_feeds = {"query": feeds["query"], "key": feeds["key"], "sparse_indices": feeds["sparse_indices"],
                  "d_out": np.ones_like(out["out"]), "out": out["out"], "softmax_max": out["softmax_max"],
                  "softmax_sum": out["softmax_sum"], "value": feeds["value"], "query_rope": feeds["query_rope"],
                  "key_rope": feeds["key_rope"]}
    grad = _compile_one_node("sfa_grad", "SparseFlashAttentionGrad", grad_feeds,
                             ("d_query", "d_key", "d_value", "d_query_rope", "d_key_rope"), scale_value=scale,
                             sparse_mode=0)
    dqk, dv, rows = d + dr, d, batch * seq_q * heads
    grad_flops = 2 * topk * (3 * dqk + 2 * dv) * rows
    forward_flops = 2 * topk * (dqk + dv) * rows
    rng = np.random.default_rng(1)
    a = rng.standard_normal((rows, dqk), np.float32)
    b = rng.standard_normal((dqk, topk), np.float32)
    t_matmul = best_time(lambda: a @ b, repeat)
    matmul_rate = 2 * rows * dqk * topk / t_matmul
    timings = [("float32 matmul (S1*N1 x Dqk) @ (Dqk x K)", t_matmul, 2 * rows * dqk * topk),
               ("geir numpy runtime, grad", best_time(lambda: grad.run(grad_feeds), repeat), grad_flops),
               ("geir numpy runtime, forward", best_time(lambda: forward.run(feeds), repeat), forward_flops)]
    label = f"B={batch} S1={seq_q} S2={seq_kv} N1={heads} K={topk} D={d} Dr={dr} float16"
    rows_out = [(label, name, f"{t * 1e3:.2f}", f"{flops / t / 1e9:.1f}", f"{flops / t / matmul_rate:.0%}")
                for name, t, flops in timings]
    title = "SparseFlashAttention(Grad), BSND, block 1, sparse_mode 0 (target: grad >= 30% of the matmul rate)"
    return title + "\n" + format_table(("case", "implementation", "ms", "GFLOP/s", "vs matmul"), rows_out)


BENCHES: dict[str, Callable[..., str]] = {"rotary": bench_rotary, "moe": bench_moe, "sfa": bench_sfa}
