"""The ONNX Runtime runtime: graphs run as their exported ONNX model in one cached InferenceSession."""

from __future__ import annotations

from ._session import OnnxRuntimeExecutable, OnnxRuntimeRuntime, validate_graph_inputs

__all__ = ["OnnxRuntimeExecutable", "OnnxRuntimeRuntime", "validate_graph_inputs"]
