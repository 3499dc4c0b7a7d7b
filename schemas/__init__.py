"""Operator declarations: one folder per operator family (rotary/, moe/, sparse_attention/), each
registering its schemas, ONNX bodies and device restrictions; plus the schema machinery."""

from __future__ import annotations

from ._onnx_body import OPSET
from ._registry import all_schemas, get_schema, register
from ._schema import REQUIRED, AttrKind, AttrSpec, DataContext, InferContext, InputSpec, OpSchema, OutputSpec
from . import moe, rotary, sparse_attention  # noqa: E402,F401  (each family registers its ops, bodies, rules)

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
