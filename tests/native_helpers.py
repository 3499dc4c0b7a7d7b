"""What the native-library tests share: the skip when no C compiler exists, fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from geir.runtimes.onnxruntime._native import find_compiler

requires_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler (cc or gcc) on PATH, so the "
                                       "native library cannot be built; these tests cover the native kernels only")


def run_isolated(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (its own native-library state), from the repository root."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=str(Path(__file__).parents[1]), timeout=timeout)
