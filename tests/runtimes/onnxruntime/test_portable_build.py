"""The native library built as for a CPU without AVX, AVX2, FMA or F16C: its portable paths (scalar
conversions, 16-byte vectors in the matrix multiply and the softmax, the MoE rows without intrinsics) pass
the same native tests as the build for this CPU, which alone would leave them untested on an AVX2 machine;
its AVX-512 paths, which this machine cannot run, compile cleanly; and the native tests pass with
AddressSanitizer watching every access."""

from __future__ import annotations

import ctypes
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from geir.runtimes.onnxruntime._native import CFLAGS, SOURCES, find_compiler
from native_helpers import requires_compiler

HERE = Path(__file__).parent
TESTS = HERE.parents[1]
NATIVE_TESTS = ("runtimes/onnxruntime/test_native.py", "runtimes/onnxruntime/test_native_families.py",
                "runtimes/onnxruntime/test_native_gemm.py", "runtimes/onnxruntime/test_native_limits.py",
                "runtimes/onnxruntime/test_native_self_test.py",
                "rotary/test_rotary_native.py", "moe/test_moe_native.py", "sparse_attention/test_sfa_native.py",
                "sparse_attention/test_sfa_grad_determinism.py")
PORTABLE_FLAGS = ("-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c")


def _native_tests_on(cache: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the native test files in a fresh interpreter whose library is built into ``cache`` (with ``env``'s CC);
    return the run, passed, and the one library it built."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             *(str(TESTS / name) for name in NATIVE_TESTS)], capture_output=True, text=True,
                            env={**os.environ, **env, "GEIR_CACHE_DIR": str(cache)}, cwd=str(HERE.parents[2]),
                            timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    libraries = list(cache.glob("libgeir_ort-*.so"))
    assert len(libraries) == 1, libraries          # the tests ran on that library, built once
    return result, libraries[0]


@pytest.mark.slow
@requires_compiler
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the flags that turn the "
                    "vector extensions off are x86's; elsewhere the build for the CPU is the portable one")
def test_the_portable_build_passes_the_native_tests(tmp_path):
    compiler = find_compiler()
    assert compiler is not None
    _, library = _native_tests_on(tmp_path, {"CC": shlex.join([*compiler, *PORTABLE_FLAGS])})
    assert ctypes.CDLL(str(library)).geir_gemm_vector_floats() == 4   # 16-byte vectors: no AVX in it


AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c", "-mfma")


@pytest.mark.slow
@requires_compiler
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AVX-512 is an x86 extension")
def test_the_avx512_paths_compile_without_warnings(tmp_path):
    """This machine cannot run AVX-512 code, so its paths (16-float vectors, the 512-bit float16 rounding) are at
    least compiled here, with every warning an error: a type or intrinsic mistake in them fails this test."""
    compiler = find_compiler()
    assert compiler is not None
    probe = subprocess.run([*compiler, *AVX512_FLAGS, "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                           text=True, timeout=60)
    if "__AVX512F__" not in probe.stdout:
        pytest.skip(f"{compiler[0]} cannot target AVX-512")   # an old or non-GCC-compatible compiler
    flags = [f for f in CFLAGS if f != "-shared"]
    for source in SOURCES:
        result = subprocess.run([*compiler, *flags, *AVX512_FLAGS, "-Werror", "-c", "-o",
                                 str(tmp_path / f"{source.stem}.o"), str(source)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (source.name, result.stderr[-3000:])


@pytest.mark.slow
@requires_compiler
@pytest.mark.skipif(sys.platform != "linux", reason="AddressSanitizer is preloaded the Linux way (LD_PRELOAD)")
def test_the_native_tests_pass_under_address_sanitizer(tmp_path):
    """The library built with -fsanitize=address runs the native tests: an out-of-bounds read or write, a use after
    free or a double free in any kernel aborts the run (the kernels' bounds are the data's, not just the tests')."""
    compiler = find_compiler()
    assert compiler is not None
    runtime_libraries = []
    for name in ("libasan.so", "libstdc++.so.6"):   # ASan first; libstdc++ so it can intercept ONNX Runtime's throws
        found = subprocess.run([*compiler, f"-print-file-name={name}"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
        if not os.path.isabs(found):
            pytest.skip(f"{compiler[0]} has no {name} to preload")  # a compiler without AddressSanitizer
        runtime_libraries.append(found)
    env = {"CC": shlex.join([*compiler, "-fsanitize=address", "-fno-omit-frame-pointer"]),
           "LD_PRELOAD": " ".join(runtime_libraries),
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}   # leaks: Python's own allocations are not ours
    result, _ = _native_tests_on(tmp_path, env)
    assert "AddressSanitizer" not in result.stderr
