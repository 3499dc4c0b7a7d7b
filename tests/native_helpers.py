"""What the native-library tests share: the skip when no C compiler exists, fresh interpreters, the kernels' call
counter."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from geir.runtimes.onnxruntime import native_library
from geir.runtimes.onnxruntime._native import find_compiler

requires_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler (cc or gcc) on PATH, so the "
                                       "native library cannot be built; these tests cover the native kernels only")


def run_isolated(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (its own native-library state), from the repository root."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=str(Path(__file__).parents[1]), timeout=timeout)


def native_calls() -> int:
    """How many times the native kernels have run in this process (a kernel that ran, not the function body)."""
    counter = ctypes.CDLL(native_library()).geir_native_calls
    counter.restype = ctypes.c_long
    return counter()


COPYING_COMPILER = """#!/bin/sh
# A stand-in C compiler: compile steps (-c) write an empty object, the link step copies {library}.
# Each run is logged, one line ("compile" or "link"), to {log}; the link step first sleeps {delay} s.
out=""
step=link
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    -c) step=compile ;;
  esac
  shift
done
echo "$step" >> '{log}'
if [ "$step" = compile ]; then : > "$out"; else sleep {delay}; cp '{library}' "$out"; fi
"""


def copying_compiler(directory: Path, delay: float = 0) -> tuple[str, Path]:
    """A stand-in for ``CC`` whose "build" copies the library this test session built (``native_library()``, once
    per session and machine): for the tests of the cache's trust rules, which need a library built into a cache
    of their own, not another real compile of the same source. Returns the command and the log of its runs (one
    line per compile step, ``link`` per library written). ``delay``: seconds each link takes, as a real build
    takes its time (a concurrent first use then meets a build in progress)."""
    from geir.runtimes.onnxruntime import native_library, native_status

    library = native_library()
    assert library is not None, native_status()
    directory.mkdir(parents=True, exist_ok=True)
    compiler, log = directory / "copycc", directory / "copycc.log"
    compiler.write_text(COPYING_COMPILER.format(library=library, log=log, delay=delay))
    compiler.chmod(0o755)
    return str(compiler), log


def links(log: Path) -> int:
    """How many libraries the copying compiler has written."""
    return log.read_text().split().count("link") if log.exists() else 0
