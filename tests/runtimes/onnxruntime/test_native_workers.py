"""Several pytest-xdist workers (``--tx popen``) meeting an empty native cache at once: one builds the library,
the others wait for it, and every worker loads and runs that one file (geir's pytest plugin and its
``--geir-runtime`` option work in the workers too).

The workers' "compiler" is the stand-in that copies the library this session built and logs each link
(native_helpers.copying_compiler); each link takes a second, and the workers meet at a barrier before their first
use, so without a lock between processes every worker would build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from native_helpers import copying_compiler, links, requires_compiler

pytest.importorskip("xdist", reason="pytest-xdist is not installed (the test extra has it: pip install -e '.[test]')")

WORKERS = 3

WORKER_TEST = """
    import ctypes, json, os, time
    from pathlib import Path
    import numpy as np, geir

    def test_this_worker_runs_the_shared_library(geir_runtime):
        records = Path(os.environ["GEIR_TEST_RECORDS"])
        worker = os.environ["PYTEST_XDIST_WORKER"]
        (records / f"{worker}.arrived").touch()
        deadline = time.monotonic() + 120
        while len(list(records.glob("*.arrived"))) < int(os.environ["GEIR_TEST_WORKERS"]):
            assert time.monotonic() < deadline, "the other workers never arrived"
            time.sleep(0.02)
        from geir.runtimes.onnxruntime import native_library, native_status
        path = native_library()
        assert path is not None, native_status()
        counter = ctypes.CDLL(path).geir_native_calls
        counter.restype = ctypes.c_long
        before = counter()
        b = geir.GraphBuilder("rope")
        dy, c = b.input("dy", "float32", (1, 2, 1, 4)), b.input("c", "float32", (1, 2, 1, 4))
        b.output(b.InplacePartialRotaryMulGrad(dy, c, c, rotary_mode=1, partial_slice=[0, 4]), "dx")
        feeds = {"dy": np.arange(8, dtype=np.float32).reshape(1, 2, 1, 4), "c": np.full((1, 2, 1, 4), 0.5, np.float32)}
        graph = b.build()
        got = geir.run(graph, feeds, runtime=geir_runtime)["dx"]
        assert np.array_equal(got, geir.run(graph, feeds, runtime="numpy")["dx"])
        record = {"pid": os.getpid(), "path": path, "inode": os.stat(path).st_ino, "runtime": geir_runtime,
                  "native_calls": counter() - before}
        (records / f"{worker}.json").write_text(json.dumps(record))
"""


@requires_compiler
def test_popen_workers_build_the_library_once_and_all_use_it(tmp_path):
    compiler, log = copying_compiler(tmp_path / "bin", delay=1)
    cache, records, suite = tmp_path / "cache", tmp_path / "records", tmp_path / "suite"
    records.mkdir()
    suite.mkdir()
    (suite / "test_worker.py").write_text(textwrap.dedent(WORKER_TEST))
    env = {**os.environ, "GEIR_CACHE_DIR": str(cache), "CC": compiler, "GEIR_TEST_RECORDS": str(records),
           "GEIR_TEST_WORKERS": str(WORKERS)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--dist", "each",
                             "--tx", f"{WORKERS}*popen//python={sys.executable}", "--geir-runtime", "onnxruntime",
                             "test_worker.py"], cwd=suite, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{WORKERS} passed" in result.stdout, result.stdout[-3000:]

    assert links(log) == 1, f"{links(log)} builds for {WORKERS} workers"
    seen = {path.stem: json.loads(path.read_text()) for path in records.glob("*.json")}
    assert sorted(seen) == [f"gw{i}" for i in range(WORKERS)]
    assert len({r["pid"] for r in seen.values()}) == WORKERS
    library = Path(next(iter(seen.values()))["path"])
    assert library.parent == cache
    for worker, record in seen.items():
        assert record["path"] == str(library) and record["inode"] == library.stat().st_ino, worker
        assert record["runtime"] == "onnxruntime", worker       # --geir-runtime reached the worker
        assert record["native_calls"] >= 1, worker               # the rotary node ran in the library
    left = sorted(p.name for p in cache.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))
    assert left == [], f"build leftovers in the cache: {left}"
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [library.name,
                                                                                        library.name + ".sha256"]
