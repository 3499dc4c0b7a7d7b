"""The native library never crashes the process, never loads what geir did not build, never hangs:
scratch-allocation failures, corrupted or planted cache files, shared cache directories, FIFOs,
compilers that never exit, concurrent first use, and the environment switches; a build says so on stderr.

The cache tests need a library built into a cache of their own, not another compile of the same source: their
``CC`` is a stand-in that copies the library this session built (native_helpers.copying_compiler) and logs each
"build", so a rebuild is seen in its log."""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import Path

import numpy as np
import pytest

import geir
from geir import ExecutionError
from geir.runtimes.onnxruntime import native_library
from geir.runtimes.onnxruntime._native import BUILDING, USUAL_SECONDS
from moe.helpers import moe_grad_graph, moe_graph
from native_helpers import copying_compiler, links, requires_compiler, run_isolated

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(getenv("GEIR_TEST_MARKER"), "w");
  if (f) { fputs("ran", f); fclose(f); }
}
"""

STATUS = """
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from geir.runtimes.onnxruntime import native_library, native_status
        path = native_library()
    print(repr(path))
    print(native_status())
    print(len(caught))
"""


def _status(cache: Path, **env: str) -> tuple[str | None, str, int]:
    """(library path or None, status line, number of warnings) from a fresh interpreter."""
    path, status, warned, _ = _status_and_stderr(cache, **env)
    return path, status, warned


def _status_and_stderr(cache: Path, **env: str) -> tuple[str | None, str, int, str]:
    result = run_isolated(STATUS, env={"GEIR_CACHE_DIR": str(cache), **env}, timeout=240)
    assert result.returncode == 0, result.stderr
    path, status, warned = result.stdout.strip().splitlines()[-3:]
    return eval(path), status, int(warned), result.stderr


def _building_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("geir: building")]


@pytest.fixture
def copycc(tmp_path) -> tuple[str, Path]:
    """The stand-in compiler (copies the session's library) and its log."""
    return copying_compiler(tmp_path / "bin")


@requires_compiler
@pytest.mark.parametrize("op, fail_at", [("forward", 1), ("grad", 1), ("grad", 2), ("forward", 0)])
def test_failed_scratch_allocation_is_an_error_not_zeros(op, fail_at):
    """Allocation 0 checks the permutation, 1 is the forward's row buffer / the grad's inverse map, 2 the
    grad's row buffer."""
    rng = np.random.default_rng(0)
    if op == "forward":
        g = moe_graph(6, 4, 6, (3, 2))
        feeds = {"tokens": rng.standard_normal((6, 4)).astype(np.float32),
                 "indices": rng.permutation(6).astype(np.int32), "probs": np.ones((3, 2), np.float32)}
        name = "MoeTokenUnpermute"
    else:
        g = moe_grad_graph((6, 4), (3, 4), 6, (3, 2))
        feeds = {"tokens": rng.standard_normal((6, 4)).astype(np.float32),
                 "dy": rng.standard_normal((3, 4)).astype(np.float32),
                 "indices": rng.permutation(6).astype(np.int32), "probs": np.ones((3, 2), np.float32)}
        name = "MoeTokenUnpermuteGrad"
    _assert_failed_allocation_raises(g, feeds, name, fail_at)


def _assert_failed_allocation_raises(graph, feeds, name: str, fail_at: int) -> None:
    """The ``fail_at``-th next scratch allocation fails: an ExecutionError naming the op; the next run is right."""
    want = geir.run(graph, feeds, runtime="onnxruntime")
    library = ctypes.CDLL(native_library())
    library.geir_fail_allocation.argtypes = [ctypes.c_long]
    library.geir_fail_allocation(fail_at)
    try:
        with pytest.raises(ExecutionError, match=rf"{name} \(geir native kernel\): out of memory"):
            geir.run(graph, feeds, runtime="onnxruntime")
    finally:
        library.geir_fail_allocation(-1)
    again = geir.run(graph, feeds, runtime="onnxruntime")
    for key in want:
        assert np.array_equal(again[key].view(np.uint8), want[key].view(np.uint8)), key


SFA_ALLOCATIONS = {"forward": (0, 3, 5, 6, 8, 9), "grad": (0, 5, 8, 9, 12, 15, 16, 17), "forward_long_kv": (5, 6, 7)}
"""Scratch allocations of the attention kernels, in order: row metadata, block starts, the ids-seen stamps,
the entries, a row's positions (0-4); the key map indexed by key row and the distinct rows (5, 6), or for a key
tensor far larger than the keys read (``_long_kv``) the sort's order and counts and the distinct rows (5-7); the
widened keys and values (7, 8 / 8, 9); then the forward's task scratch (9 / 10); the grad's dK/dV sums (9, 10 /
10, 11), key split, query-side data and dS and its tasks' scratch."""


@requires_compiler
@pytest.mark.parametrize("op, fail_at", [(op, n) for op, ns in SFA_ALLOCATIONS.items() for n in ns])
def test_failed_attention_allocation_is_an_error_not_zeros(op, fail_at):
    from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase, sfa_graph
    case = AttentionCase(B=1, S1=4, S2=70000 if op.endswith("_long_kv") else 8, N1=2, D=8, D2=8, K=3, mode=0, seed=1)
    arrays = case.arrays()
    graph, feeds = sfa_graph(arrays, SFA, **case.forward_attrs())
    name = SFA
    if op.startswith("grad"):
        out = geir.run(graph, feeds)
        grad = {"query": arrays["query"], "key": arrays["key"], "sparse_indices": arrays["sparse_indices"],
                "d_out": arrays["query"], "out": out["attention_out"], "softmax_max": out["softmax_max"],
                "softmax_sum": out["softmax_sum"], "value": arrays["value"]}
        graph, feeds = sfa_graph(grad, SFA_GRAD, **case.grad_attrs())
        name = SFA_GRAD
    _assert_failed_allocation_raises(graph, feeds, name, fail_at)


@requires_compiler
@pytest.mark.slow   # builds the library (5-7 s on two cores): CI runs it with -m slow
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_cached_library_is_rebuilt_never_loaded(tmp_path, damage, copycc):
    compiler, log = copycc
    cache = tmp_path / "cache"
    path, _, _ = _status(cache, CC=compiler)
    assert path is not None and links(log) == 1
    library = Path(path)
    data = bytearray(library.read_bytes())
    if damage == "truncate":
        library.write_bytes(bytes(data[: len(data) // 3]))
    else:
        data[len(data) // 2] ^= 0x40      # lands in code or tables; the hash check must catch it
        library.write_bytes(bytes(data))
    again, status, warned = _status(cache, CC=compiler)
    assert again == path and warned == 0, status
    assert links(log) == 2                           # built again, not loaded
    import hashlib
    assert (library.with_name(library.name + ".sha256").read_text()
            == hashlib.sha256(library.read_bytes()).hexdigest())


def _plant(cache: Path, tmp_path: Path, compiler: str) -> tuple[Path, Path]:
    """Build once, then replace the cached library with one whose constructor writes a marker file."""
    path, _, _ = _status(cache, CC=compiler)
    assert path is not None
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    planted = tmp_path / "planted.so"
    os.system(f"cc -shared -fPIC -o {planted} {source}")
    target = Path(path)
    target.write_bytes(planted.read_bytes())
    return target, tmp_path / "marker"


@requires_compiler
@pytest.mark.slow   # builds the library (5-7 s on two cores): CI runs it with -m slow
def test_a_planted_library_without_our_hash_is_replaced_and_never_runs(tmp_path, copycc):
    compiler, log = copycc
    cache = tmp_path / "cache"
    target, marker = _plant(cache, tmp_path, compiler)
    path, status, warned = _status(cache, GEIR_TEST_MARKER=str(marker), CC=compiler)
    assert not marker.exists()
    assert path == str(target) and warned == 0, status
    assert links(log) == 2                           # replaced by a build of ours


@requires_compiler
@pytest.mark.slow   # builds the library (5-7 s on two cores): CI runs it with -m slow
def test_a_shared_cache_directory_is_refused(tmp_path, copycc):
    compiler, _ = copycc
    cache = tmp_path / "cache"
    target, marker = _plant(cache, tmp_path, compiler)
    target.with_name(target.name + ".sha256").write_text(__import__("hashlib").sha256(target.read_bytes()).hexdigest())
    os.chmod(cache, 0o777)                 # as a shared /tmp-style directory is
    path, status, warned = _status(cache, GEIR_TEST_MARKER=str(marker), CC=compiler)
    assert not marker.exists()
    assert path is None and warned == 1
    assert "is writable by others" in status and str(cache) in status


@requires_compiler
@pytest.mark.slow   # builds the library (5-7 s on two cores): CI runs it with -m slow
@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_library_owned_by_another_user_is_refused(tmp_path, copycc):
    compiler, _ = copycc
    cache = tmp_path / "cache"
    target, marker = _plant(cache, tmp_path, compiler)
    target.with_name(target.name + ".sha256").write_text(__import__("hashlib").sha256(target.read_bytes()).hexdigest())
    os.chown(target, 65534, 65534)
    path, status, warned = _status(cache, GEIR_TEST_MARKER=str(marker), CC=compiler)
    assert not marker.exists()
    assert path is None and warned == 1 and "is owned by uid 65534" in status


@requires_compiler
@pytest.mark.slow   # builds the library (5-7 s on two cores): CI runs it with -m slow
def test_a_fifo_in_the_cache_is_refused_without_hanging(tmp_path, copycc):
    compiler, _ = copycc
    cache = tmp_path / "cache"
    path, _, _ = _status(cache, CC=compiler)
    Path(path).unlink()
    os.mkfifo(path)
    again, status, warned = _status(cache, CC=compiler)
    assert again is None and warned == 1 and "is not a regular file" in status
    assert stat.S_ISFIFO(os.stat(path).st_mode)


def test_a_compiler_that_never_exits_is_stopped(tmp_path):
    compiler = tmp_path / "slowcc"
    compiler.write_text("#!/bin/sh\nexec /bin/sleep 60\n")
    compiler.chmod(0o755)
    result = run_isolated("""
        import time, warnings
        import geir.runtimes.onnxruntime._native as native
        native.COMPILE_TIMEOUT_S = 1.0
        start = time.monotonic()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            print(native.native_library(), round(time.monotonic() - start) < 30)
        print(native.native_status())
    """, env={"CC": str(compiler), "GEIR_CACHE_DIR": str(tmp_path / "cache")}, timeout=60)
    assert result.returncode == 0, result.stderr
    first, status = result.stdout.strip().splitlines()
    assert first == "None True"
    assert "did not finish within 1 s" in status


@requires_compiler
def test_concurrent_first_use_gives_every_caller_the_library(tmp_path, copycc):
    """Eight first callers at once: one build (one line on stderr), every caller gets its library."""
    compiler, log = copycc
    result = run_isolated("""
        import threading
        from geir.runtimes.onnxruntime import native_library
        seen, barrier = [], threading.Barrier(8)
        def call():
            barrier.wait()
            seen.append(native_library())
        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(len(seen), len(set(seen)), seen[0] is not None)
    """, env={"GEIR_CACHE_DIR": str(tmp_path / "cache"), "CC": compiler}, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "8 1 True"
    assert links(log) == 1 and len(_building_lines(result.stderr)) == 1, result.stderr


@requires_compiler
@pytest.mark.slow   # builds the library (5-7 s on two cores): CI runs it with -m slow
def test_a_build_says_what_it_does_on_stderr_once_and_a_cached_library_says_nothing(tmp_path, copycc):
    """The first ONNX Runtime use on a machine pauses for the compiler: one line says why and for how long."""
    compiler, log = copycc
    cache = tmp_path / "cache"
    path, _, warned, stderr = _status_and_stderr(cache, CC=compiler)
    assert path is not None and warned == 0 and links(log) == 1
    assert _building_lines(stderr) == [BUILDING.format(compiler="copycc", seconds=USUAL_SECONDS)], stderr
    assert BUILDING.format(compiler="cc", seconds=USUAL_SECONDS) == (
        "geir: building the native ONNX Runtime kernels with cc (once per machine, usually 10-30 s)...")
    again, _, _, stderr = _status_and_stderr(cache, CC=compiler)     # the cached library: no build, no word
    assert again == path and links(log) == 1 and _building_lines(stderr) == [], stderr


@pytest.mark.parametrize("value", ["false", "No", "OFF", "0"])
def test_geir_native_false_values_disable(tmp_path, value):
    path, status, warned, stderr = _status_and_stderr(tmp_path / "cache", GEIR_NATIVE=value)
    assert path is None and warned == 0 and status == f"function bodies only (disabled by GEIR_NATIVE={value})"
    assert _building_lines(stderr) == [] and not (tmp_path / "cache").exists(), stderr


@pytest.mark.parametrize("runtime", ["numpy", "onnxruntime"])
def test_geir_num_threads_is_checked_and_clamped(monkeypatch, runtime):
    from geir.runtimes._threads import available_cpus, num_threads

    g = moe_graph(2, 2, 2)
    feeds = {"tokens": np.ones((2, 2), np.float32), "indices": np.array([1, 0], np.int32)}
    monkeypatch.setenv("GEIR_NUM_THREADS", "100000")
    assert num_threads() == available_cpus()
    np.testing.assert_array_equal(geir.run(g, feeds, runtime=runtime)["y"], np.ones((2, 2), np.float32))
    for bad in ("abc", "0", "-3"):
        monkeypatch.setenv("GEIR_NUM_THREADS", bad)
        with pytest.raises(ExecutionError, match=rf"GEIR_NUM_THREADS='{bad}': expected a positive integer"):
            num_threads()
    monkeypatch.setenv("GEIR_NUM_THREADS", "abc")
    fresh = moe_graph(2, 2, 2)   # a new graph: a new session reads the setting
    with pytest.raises(ExecutionError, match="GEIR_NUM_THREADS='abc'"):
        geir.run(fresh, feeds, runtime=runtime) if runtime == "onnxruntime" else _numpy_parallel_run()


def _numpy_parallel_run() -> None:
    """A rotary run big enough for the NumPy runtime to ask for threads."""
    from helpers import random_feeds
    from rotary.helpers import rotary_graph

    g = rotary_graph("InplacePartialRotaryMulGrad", (8, 64, 8, 64), (1, 64, 1, 64), rotary_mode=1,
                     partial_slice=[0, 64])
    geir.run(g, random_feeds(g))


def test_without_a_compiler_the_onnxruntime_runtime_runs_the_function_bodies(tmp_path):
    import sys

    result = run_isolated("""
        import warnings
        import numpy as np, geir
        from geir.runtimes.onnxruntime import native_status
        from geir.runtimes.onnxruntime._native import find_compiler
        b = geir.GraphBuilder("g")
        x = b.input("x", "float32", (2, 3, 1, 8))
        c = b.input("c", "float32", (1, 3, 1, 8))
        b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 8]), "y")
        g = b.build()
        feeds = {"x": np.arange(48, dtype=np.float32).reshape(2, 3, 1, 8), "c": np.full((1, 3, 1, 8), 0.5, np.float32)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = geir.run(g, feeds, runtime="onnxruntime")["y"]
        print(find_compiler(), len(caught), np.allclose(got, geir.run(g, feeds)["y"], rtol=1e-6))
        print(native_status())
    """, env={"PATH": str(Path(sys.executable).parent), "CC": "", "GEIR_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    first, status = result.stdout.strip().splitlines()
    assert first == "None 1 True"
    assert status == "function bodies only (RuntimeError: no C compiler (cc or gcc) on PATH)"
