"""Smoke test on the oldest ONNX Runtime geir supports (run by .ci/run in its own virtual environment).

The native library declares ONNX Runtime's ABI itself (slot numbers in the OrtApi table, the
OrtCustomOp layout); a wrong slot shows up on an old runtime first, so this proves on 1.17 that
the library loads, its self-test runs the native kernel, its ABI probe works, and the demo
cases pass on the onnxruntime runtime. ONNX Runtime 1.17's Python API cannot exchange bfloat16
arrays, so bfloat16 cases are skipped here (they are checked on the current runtime by pytest).
"""

from __future__ import annotations

import ctypes
import sys

import onnxruntime

from geir.runtimes.onnxruntime import native_library, native_status
from geir.tools.demo import all_cases

OLDEST = "1.17"

assert onnxruntime.__version__.startswith(OLDEST), f"expected ONNX Runtime {OLDEST}.x, got {onnxruntime.__version__}"
path = native_library()
assert path is not None, native_status()
buffer = ctypes.create_string_buffer(512)
assert ctypes.CDLL(path).geir_probe_abi(buffer, 512) == 1 and buffer.value.startswith(b"ORT Build Info")
counter = ctypes.CDLL(path).geir_native_calls
counter.restype = ctypes.c_long
cases = [c for c in all_cases() if c.dtype != "bfloat16"]
before = counter()
failed = [c.name for c in cases if not c.run("onnxruntime")[1]]
assert counter() > before, "no demo case ran a native kernel"
print(f"ONNX Runtime {onnxruntime.__version__}: {native_status()}; ABI probe ok; "
      f"{counter() - before} native kernel calls")
print(f"smoke: {len(cases) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
