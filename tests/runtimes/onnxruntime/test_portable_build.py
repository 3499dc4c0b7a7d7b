"""The native library built as for a CPU without AVX, AVX2, FMA or F16C: its portable paths (scalar
conversions, 16-byte vectors in the matrix multiply and the softmax, the MoE rows without intrinsics) pass
the same native tests as the build for this CPU, which alone would leave them untested on an AVX2 machine."""

from __future__ import annotations

import ctypes
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from geir.runtimes.onnxruntime._native import find_compiler
from native_helpers import requires_compiler

HERE = Path(__file__).parent
NATIVE_TESTS = ("test_native.py", "test_native_sfa.py", "test_sfa_grad_determinism.py", "test_native_gemm.py")
PORTABLE_FLAGS = ("-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c")


@pytest.mark.slow
@requires_compiler
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the flags that turn the "
                    "vector extensions off are x86's; elsewhere the build for the CPU is the portable one")
def test_the_portable_build_passes_the_native_tests(tmp_path):
    compiler = find_compiler()
    assert compiler is not None
    env = {**os.environ, "CC": shlex.join([*compiler, *PORTABLE_FLAGS]), "GEIR_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             *(str(HERE / name) for name in NATIVE_TESTS)],
                            capture_output=True, text=True, env=env, cwd=str(HERE.parents[2]), timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    libraries = list(tmp_path.glob("libgeir_ort-*.so"))
    assert len(libraries) == 1, libraries          # the tests ran on the portable library, built once
    assert ctypes.CDLL(str(libraries[0])).geir_gemm_vector_floats() == 4   # 16-byte vectors: no AVX in it
