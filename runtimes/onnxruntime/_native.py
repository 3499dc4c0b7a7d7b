"""The native custom-op library: built from ``native/geir_ort.c`` with the machine's C compiler on
first use, cached, loaded into sessions, and proven by a self-test before it is trusted.

``GEIR_NATIVE=0`` disables it; when it cannot be built, loaded or proven, sessions run the
ONNX function bodies instead and geir says so once (a GeirWarning).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from geir._errors import GeirWarning

__all__ = ["native_library", "native_status"]

SOURCE = Path(__file__).with_name("native") / "geir_ort.c"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11", "-Wall"]
"""``-ffp-contract=off``: no FMA contraction, so results stay bit-identical to the NumPy runtime."""

_state: dict[str, object] = {}


def _cache_dir() -> Path:
    base = os.environ.get("GEIR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "geir")
    return Path(base)


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *CFLAGS, sys.platform]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"libgeir_ort-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, "-o", str(built), str(SOURCE)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)   # atomic: a concurrent build finds a whole file or none
    return target


def _self_test(path: Path) -> None:
    """Run a rotary grad through a session with the library; its call counter must move."""
    import numpy as np
    import onnxruntime as ort

    import geir

    b = geir.GraphBuilder("geir_native_self_test")
    x = b.input("x", "float16", (1, 2, 2, 8))
    c = b.input("c", "float16", (1, 2, 1, 8))
    b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=1, partial_slice=[0, 8]), "y")
    graph = b.build()
    feeds = {"x": np.linspace(-2, 2, 32, dtype=np.float16).reshape(1, 2, 2, 8),
             "c": np.linspace(-1, 1, 16, dtype=np.float16).reshape(1, 2, 1, 8)}
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(path))
    counter = ctypes.CDLL(str(path)).geir_native_calls
    counter.restype = ctypes.c_long
    before = counter()
    session = ort.InferenceSession(geir.to_onnx(graph).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)[0]
    if counter() == before:
        raise RuntimeError("the self-test ran the function body, not the native kernel (ONNX Runtime older than "
                           "1.17 offers no API version 17)")
    want = geir.run(graph, feeds)["y"]
    if not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
        raise RuntimeError("the native kernel's self-test result differs from the NumPy runtime")


def native_library() -> str | None:
    """Path of the loaded native library, or None (disabled, unbuildable or failed its self-test)."""
    if "path" not in _state:
        _state["path"], _state["reason"] = None, None
        if os.environ.get("GEIR_NATIVE", "1") == "0":
            _state["reason"] = "disabled by GEIR_NATIVE=0"
            return None
        try:
            path = _build()
            _self_test(path)
            _state["path"] = str(path)
        except Exception as exc:  # any failure means: run the function bodies, and say why once
            _state["reason"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"geir: native ONNX Runtime kernels unavailable ({_state['reason']}); running the ONNX "
                          f"function bodies instead", GeirWarning, stacklevel=2)
    return _state["path"]  # type: ignore[return-value]


def native_status() -> str:
    """One line saying which kernels ONNX Runtime sessions use, and why."""
    path = native_library()
    return f"native kernels: {path}" if path else f"function bodies only ({_state['reason']})"
