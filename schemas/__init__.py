"""Operator declarations: one module per operator family, each registering its schemas."""

from __future__ import annotations

from ._onnx_body import OPSET
from ._registry import all_schemas, get_schema, register
from ._schema import REQUIRED, AttrKind, AttrSpec, DataContext, InferContext, InputSpec, OpSchema, OutputSpec
from . import moe, rotary, sparse_attention  # noqa: E402,F401  (each module registers its ops)
from . import moe_onnx, rotary_onnx, sparse_attention_onnx  # noqa: E402,F401  (ONNX lowerings)

__all__ = [
    "OPSET",
    "REQUIRED",
    "AttrKind",
    "AttrSpec",
    "DataContext",
    "InferContext",
    "InputSpec",
    "OpSchema",
    "OutputSpec",
    "all_schemas",
    "get_schema",
    "register",
]
