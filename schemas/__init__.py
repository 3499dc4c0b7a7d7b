"""Operator declarations: one module per operator family, each registering its schemas."""

from __future__ import annotations

from ._registry import all_schemas, get_schema, register
from ._schema import REQUIRED, AttrKind, AttrSpec, InferContext, InputSpec, OpSchema, OutputSpec
from . import rotary  # noqa: E402,F401  (registers the rotary ops)

__all__ = [
    "REQUIRED",
    "AttrKind",
    "AttrSpec",
    "InferContext",
    "InputSpec",
    "OpSchema",
    "OutputSpec",
    "all_schemas",
    "get_schema",
    "register",
]
