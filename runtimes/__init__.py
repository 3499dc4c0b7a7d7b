"""Runtimes: the ``Runtime`` protocol and its implementations, looked up by name."""

from __future__ import annotations

from ._feeds import validate_feeds
from ._protocol import Executable, Runtime, get_runtime, register_runtime, runtime_names

__all__ = ["Executable", "Runtime", "get_runtime", "register_runtime", "runtime_names", "validate_feeds"]


def _numpy_runtime() -> Runtime:
    from .numpy import NumpyRuntime

    return NumpyRuntime()


def _onnxruntime_runtime() -> Runtime:
    from .onnxruntime import OnnxRuntimeRuntime

    return OnnxRuntimeRuntime()


register_runtime("numpy", _numpy_runtime)
register_runtime("onnxruntime", _onnxruntime_runtime)
