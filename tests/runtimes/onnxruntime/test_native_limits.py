"""The native kernels have no limit the schemas do not state, and their memory follows the data they read
(issue 23, items 12, 16 and 24): no variable-length array or alloca (the build refuses one), a head group of any
size, a rotary slice of any length, and a paged cache whose size does not matter, only the keys read."""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import geir
from geir.runtimes.onnxruntime import native_library
from geir.runtimes.onnxruntime._native import CFLAGS, NATIVE, SOURCES, find_compiler
from helpers import random_feeds
from native_helpers import native_calls, requires_compiler, run_isolated
from oracles.numerics import bits_equal
from oracles.sfa import forward_reference
from rotary.helpers import ROPE, ROPE_GRAD, rotary_graph

pytestmark = requires_compiler


def _distance(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# ---- item 12: no stack allocation sized by the data ------------------------------------------------------------

def test_the_build_refuses_a_variable_length_array(tmp_path):
    """The library's own flags make a VLA a compile error, so none can come back; and no source calls alloca."""
    compiler = find_compiler()
    assert compiler is not None
    source = tmp_path / "vla.c"
    source.write_text("void f(int n, float* out) { float scratch[n]; scratch[0] = 1; out[0] = scratch[0]; }\n")
    flags = [f for f in CFLAGS if f != "-shared"]
    result = subprocess.run([*compiler, *flags, "-c", "-o", str(tmp_path / "vla.o"), str(source)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "vla" in result.stderr, result.stderr
    for path in [*SOURCES, *NATIVE.glob("*.h")]:
        assert not re.search(r"\balloca\b", path.read_text()), path.name


@pytest.mark.slow
def test_no_native_function_has_a_large_stack_frame(tmp_path):
    """Every function's frame is small and fixed (GCC's -Wframe-larger-than, made an error): buffers whose size a
    tensor sets live on the heap, where a failed allocation is an error, not a crash."""
    compiler = find_compiler()
    assert compiler is not None
    compiler = [f for f in compiler if not f.startswith("-fsanitize")]   # a sanitizer's redzones are not ours
    flags = [f for f in CFLAGS if f != "-shared"]
    for source in SOURCES:
        result = subprocess.run([*compiler, *flags, "-Werror=frame-larger-than=8192", "-c", "-o",
                                 str(tmp_path / f"{source.stem}.o"), str(source)],
                                capture_output=True, text=True, timeout=300)
        if "frame-larger-than" in result.stderr and "unrecognized" in result.stderr:
            pytest.skip(f"{compiler[0]} has no -Wframe-larger-than")
        assert result.returncode == 0, (source.name, result.stderr[-2000:])


# ---- items 12 and 24, in one fresh interpreter (a crash fails the tests, not the suite) ------------------------

ISOLATED = """
    import ctypes, json, resource, sys
    stack = 1 << 20   # a 1 MiB main stack: the old float divisor[G] (2 MiB below) overflowed it
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    resource.setrlimit(resource.RLIMIT_STACK, (stack if hard == resource.RLIM_INFINITY else min(stack, hard), hard))
    import numpy as np, geir
    sys.path[:0] = ["tests"]
    from geir.runtimes.onnxruntime import native_library
    from sparse_attention.helpers import SFA, SFA_GRAD, sfa_grad_feeds, sfa_graph
    counter = ctypes.CDLL(native_library()).geir_native_calls
    counter.restype = ctypes.c_long
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # MiB

    # item 24 first (peak memory is still low): one key read through a 1 MiB block_table from 2^24 cache rows
    pages, page = 1 << 20, 16
    key = np.zeros((pages, page, 1, 1), np.float16)   # calloc'd: the untouched cache is not resident
    key[700001, 3] = 1.5
    table = np.full((1, 1 << 18), -1, np.int32)
    table[0, 0] = 700001
    feeds = dict(query=np.ones((1, 1, 1, 1), np.float16), key=key, value=key, block_table=table,
                 sparse_indices=np.full((1, 1, 1, 1), 3, np.int32), actual_seq_lengths_kv=np.array([4], np.int32))
    graph, feeds = sfa_graph(feeds, SFA, scale_value=1.0, sparse_mode=0, layout_kv="PA_BSND")
    before, calls = peak(), counter()
    paged = geir.run(graph, feeds, runtime="onnxruntime")["attention_out"]
    paged = {"value": float(paged.reshape(-1)[0]), "growth_mib": peak() - before, "native": counter() - calls}
    print(json.dumps({"paged": paged}), flush=True)   # reported before item 12 runs (and may crash)
    del key, feeds

    # item 12: N1 = 2^19 query heads on one KV head, forward and grad on both runtimes
    G, D = 1 << 19, 2
    rng = np.random.default_rng(0)
    arrays = dict(query=rng.standard_normal((1, 1, G, D)).astype(np.float16),
                  key=rng.standard_normal((1, 4, 1, D)).astype(np.float16),
                  value=rng.standard_normal((1, 4, 1, D)).astype(np.float16),
                  sparse_indices=np.array([2, 0, 3, -1], np.int32).reshape(1, 1, 1, 4))
    forward, feeds = sfa_graph(arrays, SFA, scale_value=0.5, sparse_mode=0, return_softmax_lse=True)
    results, native = {}, {}
    for runtime in ("numpy", "onnxruntime"):
        calls = counter()
        out = geir.run(forward, feeds, runtime=runtime)
        d_out = arrays["query"][..., ::-1] / np.float16(64)   # d_key, d_value: sums over 2^19 heads, in range
        grad, grad_feeds = sfa_graph(sfa_grad_feeds({**arrays, "query_rope": None, "key_rope": None}, out, d_out,
                                                    "BSND"), SFA_GRAD, scale_value=0.5, sparse_mode=0)
        d = geir.run(grad, grad_feeds, runtime=runtime)
        native[runtime] = counter() - calls
        results.update({f"{runtime}_{k}": v for k, v in {**out, **d}.items()})
    np.savez(sys.argv[1], **arrays, **results)
    print(json.dumps({"native": native}))
"""


@pytest.fixture(scope="module")
def isolated(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """The run of ISOLATED, what it reported (a JSON object a line), and the file of the arrays it saved."""
    saved = tmp_path_factory.mktemp("native_limits") / "large_group.npz"
    result = run_isolated(ISOLATED.replace("sys.argv[1]", repr(str(saved))), timeout=300)
    report = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            report.update(json.loads(line))
    return result, report, saved


def test_a_large_head_group_runs_on_both_runtimes(isolated):
    """N1 = 2^19 query heads on one KV head under a 1 MiB stack (the forward's softmax kept a float per head on the
    stack: SIGSEGV): the forward and the grad run on both runtimes (natively on ONNX Runtime), the forwards agree
    with the float64 oracle and the runtimes with each other."""
    result, report, saved = isolated
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
    assert report["native"] == {"numpy": 0, "onnxruntime": 2}, "the native kernels did not run"
    r = np.load(saved)
    want, mx, sm = forward_reference(r["query"], r["key"], r["value"], r["sparse_indices"], scale=0.5, mode=0,
                                     round_to=np.float16)
    for runtime in ("numpy", "onnxruntime"):
        assert _distance(r[f"{runtime}_attention_out"], want) <= 5e-3, runtime
        assert _distance(r[f"{runtime}_softmax_max"], mx) <= 1e-6, runtime
        assert _distance(r[f"{runtime}_softmax_sum"], sm) <= 1e-5, runtime
    for name in ("attention_out", "d_query", "d_key", "d_value"):
        assert _distance(r[f"onnxruntime_{name}"], r[f"numpy_{name}"]) <= 1e-3, name
    for name in ("d_key", "d_value"):   # finite, and not trivially zero
        assert np.isfinite(r[f"numpy_{name}"].astype(np.float32)).all() and np.abs(r[f"numpy_{name}"]).max() > 1


def test_paged_attention_memory_follows_the_keys_read(isolated):
    """One key read through a 1 MiB block_table from a cache of 2^24 rows: the run's peak memory grows by a few
    MiB (by 64 MiB, 4 bytes per cache row, when the plan mapped every key tensor row), and the output is that
    key's value. A bound on memory, not on time: generous, measured in a fresh interpreter."""
    result, report, _ = isolated
    assert "paged" in report, f"exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
    paged = report["paged"]
    assert paged["native"] == 1, "the native kernel did not run"
    assert paged["value"] == 1.5                # softmax over one key is 1: the output is its value row
    assert paged["growth_mib"] < 24, f"peak RSS grew by {paged['growth_mib']:.1f} MiB for one key read"


# ---- item 16: a rotary slice of any length -----------------------------------------------------------------------

@pytest.mark.parametrize("op", [ROPE, ROPE_GRAD])
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("dtype, length", [("float32", 2052), ("bfloat16", 2048), ("float16", 2052)])
def test_a_rotary_slice_over_1024_runs_natively_and_bit_identically(op, mode, dtype, length):
    """The schema sets no maximum slice (D <= 1024 is a device rule), so the native kernel takes any length, with
    the same bits as the NumPy kernel: 2048 takes the in-register 16-bit path (modes 0-2), 2052 the row buffers."""
    g = rotary_graph(op, (2, 3, 2, length + 9), (1, 3, 1, length), dtype, rotary_mode=mode,
                     partial_slice=[5, 5 + length])
    feeds = random_feeds(g, seed=mode)
    before = native_calls()
    theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert native_calls() > before               # the native kernel ran, not the function body
    assert bits_equal(theirs, geir.run(g, feeds)["y"])


def test_a_failed_rotary_allocation_is_an_error_not_zeros():
    """The tables (allocation 0) and a task's rows (1) now live on the heap: failing either is an ExecutionError
    naming the op, and the next run is right."""
    g = rotary_graph(ROPE, (1, 2, 2, 40), (1, 2, 1, 32), "float16", rotary_mode=0, partial_slice=[4, 36])
    feeds = random_feeds(g, seed=2)
    want = geir.run(g, feeds)["y"]
    library = ctypes.CDLL(native_library())
    library.geir_fail_allocation.argtypes = [ctypes.c_long]
    for fail_at in (0, 1):
        library.geir_fail_allocation(fail_at)
        try:
            with pytest.raises(geir.ExecutionError, match=r"InplacePartialRotaryMul \(geir native kernel\): out of memory"):
                geir.run(g, feeds, runtime="onnxruntime")
        finally:
            library.geir_fail_allocation(-1)
        assert bits_equal(geir.run(g, feeds, runtime="onnxruntime")["y"], want)
