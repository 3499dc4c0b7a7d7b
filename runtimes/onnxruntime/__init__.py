"""The ONNX Runtime runtime: graphs run as their exported ONNX model in one cached InferenceSession."""

from __future__ import annotations

from ._native import native_library, native_status
from ._session import OnnxRuntimeExecutable, OnnxRuntimeRuntime

__all__ = ["OnnxRuntimeExecutable", "OnnxRuntimeRuntime", "native_library", "native_status"]
