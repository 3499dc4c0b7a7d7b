"""``geir bench``: every op on both runtimes, side by side with the peers a user would otherwise use.

Memory-bound ops are compared with ``np.copyto`` of the bytes they must move (effective GB/s; per
byte, the faster of copying that many bytes and two or four times as many, see ``larger_copies``), attention with a float32 matrix multiply of comparable size (GFLOP/s); PyTorch CPU eager runs
the same math when it is installed. All timings of a table come from one run (best of
``repeat``), so the ratios hold on a shared machine whose absolute speed drifts.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable

import numpy as np

from ..ir._core import Graph
from .builder import GraphBuilder
from .facade import fuse
from ..runtimes import get_runtime, runtime_names
from ..ir._registry import get_schema
from ..schemas import FAMILIES, BenchCase, moe, rotary, sparse_attention
from ..schemas.moe.examples import MoeCase
from ..schemas.rotary.examples import RotaryCase

from ._table import format_table
from .bench_plot import bars, draw, pyplot
from .bench_rows import Measurement, verdicts
from .bench_torch_peers import torch_moe_grad, torch_rotary_grad, torch_sfa_grad
from .bench_onnx import import_measurements, onnx_run_measurements
from .bench_models import model_measurements, models_available
from .model_io import CommandError

HEADERS = ("op", "case", "implementation", "ms", "throughput", "vs baseline", "target")
WARM_COPY, FRESH_COPY, MATMUL = "warm np.copyto, 1-4x the bytes", "same, into a fresh buffer", "float32 matmul"
BUFFERS = ", caller buffers"
NATIVE_TARGET = 1.3
"""Native memory-bound kernels with caller-provided outputs: at most this many times a warm copy of their bytes."""
MEMORY_TARGETS = {"geir onnxruntime": ((FRESH_COPY, 1.2),), "geir onnxruntime" + BUFFERS: ((WARM_COPY, NATIVE_TARGET),)}
"""Issue 13's targets for the memory-bound ops, as (baseline row, the most this row may cost as a multiple of it)."""
ATTENTION_TARGETS = {"SparseFlashAttentionGrad": {"geir onnxruntime": ((MATMUL, 2.0),), "geir numpy": ((MATMUL, 4.0),)},
                     "SparseFlashAttention": {"geir onnxruntime": ((MATMUL, 1 / 0.6),), "geir numpy": ((MATMUL, 4.0),)}}
"""Attention at >= 50 % (grad) / 60 % (forward) of the matmul's FLOP rate natively, >= 25 % on the NumPy runtime."""


SETTLE_S = 0.3
"""Pause before each row: BLAS worker threads of the previous row (NumPy's matmul) spin for about 0.1 s after
their last job and would take CPU from this row's threads."""


LARGEST_COPY = 1 << 30
"""Bytes the largest copy of a copy baseline may take (it allocates a source and a destination of this size)."""


BATCH_S = 0.005
"""Calls shorter than this are timed in batches (best batch / its length): one microsecond-scale call timed
alone measures the timer and the CPU waking up as much as the call."""


def _warmed_batch(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> int:
    """Calls of ``fn`` per timed batch (a batch lasts about ``BATCH_S``; one call for a longer one), after warming
    it up: a first call (page in buffers, first-call costs, session creation), then one batch (caches and clocks
    settle)."""
    start = clock()
    fn()
    first = clock() - start
    if first >= BATCH_S:
        return 1
    batch = max(1, int(BATCH_S / max(first, 1e-7)))
    for _ in range(batch):
        fn()
    return batch


def best_time(fn: Callable[[], object], repeat: int) -> float:
    time.sleep(SETTLE_S)
    batch = _warmed_batch(fn)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        best = min(best, (time.perf_counter() - start) / batch)
    return best


INTERLEAVED_ROUNDS = 30
"""Rounds of an interleaved timing of short calls at the least (``repeat`` when that is more): each row's best of
this many. Where some call lasts longer than a batch, ``repeat`` rounds, as ``best_time`` times it."""


def interleaved_best(fns: list[Callable[[], object]], repeat: int,
                     clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The best time per call of each of ``fns`` over rounds that each time a batch of every one in turn (batches
    sized and warmed up as ``best_time``'s)."""
    time.sleep(SETTLE_S)
    batches = [_warmed_batch(fn, clock) for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(max(repeat, INTERLEAVED_ROUNDS) if min(batches) > 1 else repeat):
        for i, (fn, batch) in enumerate(zip(fns, batches)):
            start = clock()
            for _ in range(batch):
                fn()
            best[i] = min(best[i], (clock() - start) / batch)
    return best


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _torch_compiled(torch, op: str, case: str, fn: Callable, args: tuple, work: float, unit: str) -> list["Measurement"]:
    """``torch.compile`` of the eager peer's math, when it works on this machine: the first call compiles (its
    time is reported in the row's name, not counted), the row times the compiled calls. A machine where
    compiling fails gets a row saying why instead of a time."""
    compiled = torch.compile(fn, dynamic=False)
    start = time.perf_counter()
    try:
        compiled(*args)
    except Exception as exc:   # an inductor without a working C++ toolchain, say: report it, measure the rest
        print(f"torch.compile unavailable for {op} ({case}): {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return []
    seconds = time.perf_counter() - start
    return [Measurement(op, case, f"torch.compile (compiled in {seconds:.0f} s)", lambda: compiled(*args), work, unit)]


def larger_copies(nbytes: int, fresh: bool = False) -> tuple[tuple[Callable[[], Callable[[], object]], float], ...]:
    """``np.copyto`` of 2x and 4x ``nbytes`` (at most LARGEST_COPY), as ``Measurement.also`` of a copy baseline.

    glibc's memcpy changes strategy for large copies (on this project's VMs at about 200 MB: 28-31 GB/s above, 17-19
    GB/s below), so a copy of exactly the op's bytes can stand for a slower memory than the machine has, and a
    kernel would look faster than a copy only because the op moves fewer bytes. The copy baseline is the machine's
    best rate for at least the op's bytes instead."""
    def factory(size: int) -> Callable[[], Callable[[], object]]:
        return lambda: _copy_call(np.ones(size, np.uint8), fresh)
    return tuple((factory(nbytes * k), 2.0 * nbytes * k) for k in (2, 4) if nbytes * k <= LARGEST_COPY)


def _copy_call(src: np.ndarray, fresh: bool) -> Callable[[], object]:
    """``np.copyto`` of ``src`` into a new array on each call (fresh) or into one kept destination (warm)."""
    if fresh:
        return lambda: np.copyto(np.empty_like(src), src)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def copy_baselines(op: str, case: str, src: np.ndarray, moved: float) -> list[Measurement]:
    """A case's warm copy (its baseline) and fresh-buffer copy rows: ``src`` copied, counted as ``moved`` bytes, each
    also at 2x and 4x the bytes (``larger_copies``)."""
    return [Measurement(op, case, WARM_COPY, _copy_call(src, False), moved, "GB/s", baseline=True,
                        also=larger_copies(src.nbytes)),
            Measurement(op, case, FRESH_COPY, _copy_call(src, True), moved, "GB/s",
                        also=larger_copies(src.nbytes, fresh=True))]


def _compile(runtime: str, name: str, op: str, feeds: dict[str, np.ndarray], outputs: tuple[str, ...], **attrs):
    b = GraphBuilder(name)
    inputs = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items()}   # feeds are keyed by input name
    results = getattr(b, op)(**inputs, **attrs)
    for value, out_name in zip(results if isinstance(results, tuple) else (results,), outputs):
        if value is not None:
            b.output(value, out_name)
    return get_runtime(runtime).compile(b.build())


def _runtimes(op: str, case: str, feeds, outputs, work: float, unit: str, name: str,
              targets: dict[str, tuple[tuple[str, float], ...]] | None = None, buffers: bool = False,
              beat_torch: bool = False, **attrs) -> list[Measurement]:
    """One measurement per runtime (and with ``buffers``, one more writing into reused caller buffers);
    ``targets`` by row name."""
    targets = targets or {}
    rows = []
    for runtime in runtime_names():
        executable = _compile(runtime, name, op, feeds, outputs, **attrs)
        label = f"geir {runtime}"
        rows.append(Measurement(op, case, label, lambda e=executable: e.run(feeds), work, unit,
                                targets=targets.get(label, ()), beat_torch=beat_torch and runtime == "onnxruntime"))
        if buffers:
            reused = {k: np.empty_like(v) for k, v in executable.run(feeds).items()}
            rows.append(Measurement(op, case, label + BUFFERS, lambda e=executable, r=reused: e.run(feeds, outputs=r),
                                    work, unit, targets=targets.get(label + BUFFERS, ())))
    return rows


# -- rotary --------------------------------------------------------------------------------------
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


def _as_torch(torch, array: np.ndarray):
    import ml_dtypes

    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _rotary_case(spec: RotaryCase, compiled: bool) -> list[Measurement]:
    """One case's measurements; a function of its own so every closure binds this case's arrays."""
    torch = _torch()
    arrays = spec.arrays()
    feeds = {"dy": arrays["x"], "cos": arrays["cos"], "sin": arrays["sin"]}
    pslice = spec.partial_slice
    dy = feeds["dy"]
    moved = 2 * dy.nbytes
    case = f"{list(spec.shape)} {spec.dtype} slice {list(pslice)}"
    op = "InplacePartialRotaryMulGrad"
    rows = copy_baselines(op, case, dy, moved)
    numpy_target = {"geir numpy": ((WARM_COPY, 4.0),)}
    rows += _runtimes(op, case, feeds, ("dx",), moved, "GB/s", "rope_grad", {**MEMORY_TARGETS, **numpy_target},
                      buffers=True, beat_torch=True, **spec.attributes())
    rows.append(Measurement(op, case, "naive NumPy formula", lambda: naive_rotary_grad(*feeds.values(), *pslice),
                            moved, "GB/s"))
    if torch is not None:
        t_args = [_as_torch(torch, a) for a in feeds.values()]
        rows.append(Measurement(op, case, "PyTorch eager", lambda: torch_rotary_grad(torch, *t_args, *pslice),
                                moved, "GB/s"))
        if compiled:
            rows += _torch_compiled(torch, op, case, lambda *a: torch_rotary_grad(torch, *a, *pslice), tuple(t_args),
                                    moved, "GB/s")
    fwd = spec.arrays(cos_dtype="float32")
    rows += _runtimes("InplacePartialRotaryMul", case, fwd, ("y",), moved, "GB/s", "rope",
                      {**MEMORY_TARGETS, **numpy_target}, buffers=True, **spec.attributes())
    return rows


def rotary_measurements(quick: bool) -> list[Measurement]:
    """InplacePartialRotaryMul and its grad on every runtime, against copying their bytes, the naive NumPy formula
    and PyTorch."""
    return [m for spec in rotary.examples.BENCH["quick" if quick else "bench"] for m in _rotary_case(spec, not quick)]


# -- MoE -------------------------------------------------------------------------------------------
def naive_moe_grad(tokens: np.ndarray, grad: np.ndarray, indices: np.ndarray, probs: np.ndarray):
    """The spec's formula written the obvious NumPy way (full-size float32 temporaries)."""
    n, topk = probs.shape
    out = np.empty((indices.size, grad.shape[1]), grad.dtype)
    out[indices] = (grad.astype(np.float32)[:, None, :] * probs.astype(np.float32)[:, :, None]).reshape(
        indices.size, -1).astype(grad.dtype)
    pg = (tokens.astype(np.float32)[indices.reshape(n, topk)] * grad.astype(np.float32)[:, None, :]).sum(-1)
    return out, pg.astype(probs.dtype)


def _moe_case(spec: MoeCase, compiled: bool) -> list[Measurement]:
    """One case's measurements; a function of its own so every closure binds this case's arrays."""
    torch = _torch()
    feeds = spec.arrays()
    moved = 2 * feeds["permuted_tokens"].nbytes + feeds["unpermuted_tokens_grad"].nbytes
    case = f"T={spec.tokens} K={spec.topk} H={spec.hidden} {spec.dtype}"
    op = "MoeTokenUnpermuteGrad"
    rows = copy_baselines(op, case, np.ones(moved // 2, np.uint8), moved)
    numpy_target = {"geir numpy": ((WARM_COPY, 3.0),)}
    rows += _runtimes(op, case, feeds, ("permuted_tokens_grad", "probs_grad"), moved, "GB/s", "moe_grad",
                      {**MEMORY_TARGETS, **numpy_target}, buffers=True, beat_torch=True)
    rows.append(Measurement(op, case, "naive NumPy formula", lambda: naive_moe_grad(*feeds.values()), moved, "GB/s"))
    if torch is not None:
        t_args = [_as_torch(torch, a) for a in feeds.values()]
        rows.append(Measurement(op, case, "PyTorch eager", lambda: torch_moe_grad(torch, *t_args), moved, "GB/s"))
        if compiled:
            rows += _torch_compiled(torch, op, case, lambda *a: torch_moe_grad(torch, *a), tuple(t_args), moved, "GB/s")
    fwd = {"permuted_tokens": feeds["permuted_tokens"], "sorted_indices": feeds["sorted_indices"],
           "probs": feeds["probs"]}
    rows += _runtimes("MoeTokenUnpermute", case, fwd, ("y",), feeds["permuted_tokens"].nbytes +
                      feeds["unpermuted_tokens_grad"].nbytes, "GB/s", "moe", {**MEMORY_TARGETS, **numpy_target},
                      buffers=True)
    return rows


def moe_measurements(quick: bool) -> list[Measurement]:
    """MoeTokenUnpermute and its grad on every runtime, against copying their bytes, the naive NumPy formula and
    PyTorch."""
    return [m for spec in moe.examples.BENCH["quick" if quick else "bench"] for m in _moe_case(spec, not quick)]


# -- sparse flash attention --------------------------------------------------------------------------
def sfa_measurements(quick: bool) -> list[Measurement]:
    """SparseFlashAttention and its grad on every runtime, against a float32 matmul of comparable size (GFLOP/s)
    and PyTorch."""
    return _sfa_case(sparse_attention.examples.BENCH["quick" if quick else "bench"], not quick)


def sfa_cann_measurements(quick: bool) -> list[Measurement]:
    """The CANN-sized attention shape (issue 13): its own suite, which --quick skips."""
    return [] if quick else _sfa_case(sparse_attention.examples.BENCH["cann"], True)


def _sfa_case(spec, compiled: bool) -> list[Measurement]:
    feeds = {k: v for k, v in spec.arrays().items() if v is not None}
    batch, seq_q, seq_kv, heads, topk, d, dr = spec.B, spec.S1, spec.S2, spec.N1, spec.K, spec.D, spec.Dr
    scale = spec.scale
    attrs = dict(scale_value=scale, sparse_mode=spec.mode, sparse_block_size=spec.bs)
    forward = _compile("numpy", "sfa_fwd", "SparseFlashAttention", feeds, ("out", "softmax_max", "softmax_sum"),
                       return_softmax_lse=True, **attrs)
    out = forward.run(feeds)
    grad_feeds = {"query": feeds["query"], "key": feeds["key"], "sparse_indices": feeds["sparse_indices"],
                  "d_out": np.ones_like(out["out"]), "out": out["out"], "softmax_max": out["softmax_max"],
                  "softmax_sum": out["softmax_sum"], "value": feeds["value"], "query_rope": feeds["query_rope"],
                  "key_rope": feeds["key_rope"]}
    dqk, dv, rows_total = d + dr, d, batch * seq_q * heads
    grad_flops = 2 * topk * (3 * dqk + 2 * dv) * rows_total
    forward_flops = 2 * topk * (dqk + dv) * rows_total
    rng = np.random.default_rng(1)
    a = rng.standard_normal((rows_total, dqk), np.float32)
    b = rng.standard_normal((dqk, topk), np.float32)
    c = np.empty((rows_total, topk), np.float32)   # warm output: the baseline is the multiply, not page faults
    case = f"B={batch} S1={seq_q} S2={seq_kv} N1={heads} K={topk} D={d} Dr={dr} {spec.dtype}"
    rows = [Measurement("SparseFlashAttentionGrad", case, MATMUL, lambda: np.matmul(a, b, out=c), 2 * rows_total * dqk * topk,
                        "GFLOP/s", baseline=True)]
    rows += _runtimes("SparseFlashAttentionGrad", case, grad_feeds,
                      ("d_query", "d_key", "d_value", "d_query_rope", "d_key_rope"), grad_flops, "GFLOP/s", "sfa_grad",
                      ATTENTION_TARGETS["SparseFlashAttentionGrad"], **attrs)
    torch = _torch()
    if torch is not None:
        t_feeds = {k: _as_torch(torch, v) for k, v in grad_feeds.items()}
        rows.append(Measurement("SparseFlashAttentionGrad", case, "PyTorch eager", lambda: torch_sfa_grad(
            torch, t_feeds, scale), grad_flops, "GFLOP/s"))
        if compiled:
            rows += _torch_compiled(torch, "SparseFlashAttentionGrad", case, lambda f: torch_sfa_grad(torch, f, scale),
                                    (t_feeds,), grad_flops, "GFLOP/s")
    rows += _runtimes("SparseFlashAttention", case, feeds, ("out", "softmax_max", "softmax_sum"), forward_flops,
                      "GFLOP/s", "sfa", ATTENTION_TARGETS["SparseFlashAttention"], return_softmax_lse=True, **attrs)
    return rows


def overhead_measurements(quick: bool) -> list[Measurement]:
    """A one-node graph at the smallest rotary shape on each runtime against its bare call (target <= 2x)."""
    from ..runtimes.numpy.rotary import rotary_mul_grad

    spec = RotaryCase((1, 1, 1, 8), (0, 8))
    arrays = spec.arrays()
    feeds = {"dy": arrays["x"], "cos": arrays["cos"], "sin": arrays["sin"]}
    case, op = "one node, [1, 1, 1, 8] float32", "InplacePartialRotaryMulGrad"
    ort_executable = _compile("onnxruntime", "rope_small", op, feeds, ("dx",), **spec.attributes())
    session = ort_executable.session
    calls = 1e9            # the table prints work / time / 1e9: one call per run, as calls per second
    return [Measurement(op, case, "bare NumPy kernel call", lambda: rotary_mul_grad(*feeds.values(), **spec.attributes()),
                        calls, "calls/s", baseline=True),
            Measurement(op, case, "bare ONNX Runtime session.run", lambda: session.run(None, feeds), calls, "calls/s"),
            *_runtimes(op, case, feeds, ("dx",), calls, "calls/s", "rope_small",
                       {"geir numpy": (("bare NumPy kernel call", 2.0),),
                        "geir onnxruntime": (("bare ONNX Runtime session.run", 2.0),)}, **spec.attributes())]


def rope_graph(count: int) -> Graph:
    """``count`` Llama ropes (``x * cos + cat(-x2, x1) * sin``: 7 standard nodes each) over shared tables."""
    b = GraphBuilder(f"{count}_ropes")
    cos, sin = b.input("cos", "float32", (1, 4, 1, 8)), b.input("sin", "float32", (1, 4, 1, 8))
    for i in range(count):
        x = b.input(f"x{i}", "float32", (1, 4, 2, 8))
        bounds = [b.constant(f"b{i}_{j}", np.array([v], np.int64)) for j, v in enumerate((0, 4, 8, -1, 1))]
        first = b.op("Slice", x, bounds[0], bounds[1], bounds[3], bounds[4])
        second = b.op("Slice", x, bounds[1], bounds[2], bounds[3], bounds[4])
        rotated = b.op("Concat", b.op("Neg", second), first, axis=-1)
        b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin)), f"y{i}")
    return b.build()


def fuse_measurements(quick: bool) -> list[Measurement]:
    """``geir.fuse`` on 10, 100 and 1,000 ropes (issue 23): a pass linear in the graph's size keeps the time per node
    of the 10-rope graph (target: at most 2x it)."""
    counts = (10, 100) if quick else (10, 100, 1000)
    case, rows = "ropes of 7 standard nodes, [1, 4, 2, 8] float32", []
    for count in counts:
        graph = rope_graph(count)
        name = f"{count} ropes ({len(graph.nodes)} nodes)"
        rows.append(Measurement("geir.fuse", case, name, lambda graph=graph: fuse(graph), 1e9 * len(graph.nodes),
                                "nodes/s", baseline=count == counts[0],
                                targets=() if count == counts[0] else ((rows[0].name, 2.0),)))
    return rows


# -- any other family: its examples' BENCH cases against the copy of the bytes they move ---------------
def _family_case(case: BenchCase) -> list[Measurement]:
    feeds = case.arrays()
    outputs = tuple(s.name + "_out" if s.name in feeds else s.name for s in get_schema(case.op).outputs)  # in place
    executable = _compile("numpy", case.op.lower(), case.op, feeds, outputs, **case.attributes())
    moved = sum(a.nbytes for a in feeds.values()) + sum(a.nbytes for a in executable.run(feeds).values())
    rows = copy_baselines(case.op, case.label, np.ones(max(1, moved // 2), np.uint8), moved)
    return rows + _runtimes(case.op, case.label, feeds, outputs, moved, "GB/s", case.op.lower(), buffers=True,
                            **case.attributes())


def family_suite(family: str) -> Callable[[bool], list[Measurement]]:
    """The suite of an op family with no suite of its own here: each case of ``schemas/<family>/examples.BENCH``
    on every runtime (with reused output buffers too), against copying the bytes it reads and writes."""
    def measurements(quick: bool) -> list[Measurement]:
        examples = importlib.import_module(f"{__package__.rsplit('.', 1)[0]}.schemas.{family}.examples")
        cases: tuple[BenchCase, ...] = examples.BENCH["quick" if quick else "bench"]
        return [m for case in cases for m in _family_case(case)]
    measurements.__doc__ = (f"The {family} family's benchmark cases on every runtime, against copying the bytes they "
                            "read and write.")
    return measurements


def torch_measurements(quick: bool) -> list[Measurement]:
    """geir.torch's calls against the NumPy kernels they run, and PyTorch eager (needs PyTorch).

    ``geir.torch.benchmark``, imported only when this suite runs, so no other suite imports geir.torch; without
    PyTorch it is a CommandError saying so."""
    if _torch() is None:
        raise CommandError(TORCH_NEEDED)
    from .torch.benchmark import torch_measurements as measurements

    return measurements(quick)


TORCH_NEEDED = "the torch suite needs PyTorch (pip install -e \".[models]\"); the other suites run without it"


_OWN_SUITES = {"rotary": "rotary", "moe": "moe", "sparse_attention": "sfa"}
"""Families measured by a suite of their own above (with the peers a user would otherwise use)."""

SUITES: dict[str, Callable[[bool], list[Measurement]]] = {
    "rotary": rotary_measurements, "moe": moe_measurements, "sfa": sfa_measurements, "sfa-cann": sfa_cann_measurements,
    **{family: family_suite(family) for family in FAMILIES if family not in _OWN_SUITES},
    "overhead": overhead_measurements, "fuse": fuse_measurements, "import": import_measurements,
    "onnx-run": onnx_run_measurements, "models": model_measurements, "torch": torch_measurements}


def run_benchmarks(names: list[str] | None = None, quick: bool = False, repeat: int = 5, progress=None,
                   plot: str | None = None) -> str:
    """Measure the suites ``names`` (None: every suite, as a bare ``geir bench`` runs them, leaving out the torch suite
    without PyTorch, as a note says), with a progress bar on ``progress`` (default: stderr); return one table (and
    with ``plot``, draw the ratios to that PNG file; matplotlib is checked for before anything runs). A suite named
    explicitly is run as asked: the torch suite without PyTorch is a CommandError."""
    if plot is not None:
        pyplot()
    progress = sys.stderr if progress is None else progress
    skipped = []
    if names is None:
        names = list(SUITES)
        if "torch" in names and _torch() is None:
            names, skipped = [n for n in names if n != "torch"], ["torch: no rows, it needs PyTorch (pip install -e "
                                                                   "'.[models]')"]
    plan: list[Measurement] = []
    for name in names:
        plan += SUITES[name](quick)
    times: list[float] = []
    baseline: tuple[str, float] | None = None
    ratios: list[float | None] = []
    timed_together: dict[int, float] = {}
    for i, m in enumerate(plan, 1):
        group = ([j for j, other in enumerate(plan) if other.interleaved and (other.op, other.case) == (m.op, m.case)]
                 if m.interleaved and i - 1 not in timed_together else [])
        if progress is not None:
            done = int(30 * i / len(plan))
            label = f"{len(group)} rows interleaved" if group else m.name[:40]
            progress.write(f"\r[{'#' * done}{'.' * (30 - done)}] {i}/{len(plan)} {m.op}: {label:<40}")
            progress.flush()
        if group:
            timed_together.update(zip(group, interleaved_best([plan[j].fn for j in group], repeat)))
        t = timed_together[i - 1] if m.interleaved else best_time(m.fn, repeat)
        for make, work in m.also:
            call = make()
            t = min(t, best_time(call, repeat) / work * m.work)
            del call                                     # its buffers go before the next row
        if m.baseline:
            baseline = (m.case, t / m.work)
        times.append(t)
        ratios.append(t / m.work / baseline[1] if baseline is not None and baseline[0] == m.case else None)
    if progress is not None:
        progress.write("\n")
    torch_time = {(m.op, m.case): t for m, t in zip(plan, times) if m.name == "PyTorch eager"}
    cost = {(m.case, m.name): t / m.work for m, t in zip(plan, times)}     # time per byte, flop or call
    seconds = {(m.case, m.name): t for m, t in zip(plan, times)}
    judged = [verdicts(m, t, cost, torch_time.get((m.op, m.case)), seconds) for m, t in zip(plan, times)]
    rows = [(m.op, m.case, m.name, f"{t * 1e3:.2f}", f"{m.work / t / 1e9:.4g} {m.unit}",
             "-" if ratio is None else f"{ratio:.2f}x", "; ".join(v.text for v in row) or "-")
            for m, t, ratio, row in zip(plan, times, ratios, judged)]
    met = [v.met for row in judged for v in row]
    from ..runtimes.onnxruntime import native_status

    notes = [f"onnxruntime: {native_status()}",
             *(["models: no rows, it needs torch and transformers (pip install -e '.[models]')"]
               if "models" in names and not models_available() else []),
             *skipped,
             "PyTorch eager: " + ("torch " + _torch().__version__ if _torch() is not None else "not installed"),
             "vs baseline: time per unit of work (byte moved, flop or call) as a multiple of the case's first row's (a "
             "warm np.copyto: per byte, the faster of the op's bytes and 2x or 4x them, as glibc copies large buffers "
             "faster; the float32 matmul; the bare call); target: the row it is held to and the most it may "
             "cost per unit of work against it"]
    if plot is not None:
        draw(plot, bars(zip(plan, times, ratios, judged)))
        notes.append(f"plot: {plot}")
    summary = f"targets: {sum(met)} met, {len(met) - sum(met)} missed (of {len(met)})"
    return "\n".join(notes) + "\n" + format_table(HEADERS, rows) + "\n" + summary
