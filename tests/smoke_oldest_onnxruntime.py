"""Smoke test on the oldest ONNX Runtime geir supports (run by .ci/run in its own virtual environment).

The native library declares ONNX Runtime's ABI itself (slot numbers in the OrtApi table, the
OrtCustomOp layout); a wrong slot shows up on an old runtime first, so this proves on 1.17 that
the library loads, its self-test runs the native kernel, its ABI probe works, and every demo
case passes on the onnxruntime runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import sys

import onnxruntime

from geir.runtimes.onnxruntime import native_library, native_status
from geir.tools.demo import run_demo

OLDEST = "1.17"

assert onnxruntime.__version__.startswith(OLDEST), f"expected ONNX Runtime {OLDEST}.x, got {onnxruntime.__version__}"
path = native_library()
assert path is not None, native_status()
buffer = ctypes.create_string_buffer(512)
assert ctypes.CDLL(path).geir_probe_abi(buffer, 512) == 1 and buffer.value.startswith(b"ORT Build Info")
with contextlib.redirect_stdout(io.StringIO()) as table:
    failed = run_demo("onnxruntime")
print(table.getvalue().strip().splitlines()[-1])
if failed:
    print(table.getvalue())
    sys.exit(1)
print(f"ONNX Runtime {onnxruntime.__version__}: {native_status()}; ABI probe ok")
