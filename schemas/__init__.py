"""Operator declarations: one folder per operator family (rotary/, moe/, sparse_attention/), each
registering its schemas, ONNX bodies and device restrictions; plus the schema machinery."""

from __future__ import annotations

from ._examples import BenchCase, Example, all_examples
from ..ir._onnx_body import OPSET
from ..ir._registry import all_schemas, get_schema, register
from ..ir._schema import REQUIRED, AttrKind, AttrSpec, DataContext, InferContext, InputSpec, OpSchema, OutputSpec
from ..ir._registry import import_families

from . import standard_vjp, standard_vjp_elementwise, standard_vjp_index  # noqa: F401,E402  (register the VJPs
from . import standard_vjp_linear, standard_vjp_norm, standard_vjp_reduce  # noqa: F401,E402  of the standard ops)

FAMILIES = import_families(__name__, __path__, packages_only=True)
"""The op-family folders found here (each registers its ops, bodies and device rows when imported)."""

__all__ = [
    "BenchCase",
    "Example",
    "FAMILIES",
    "OPSET",
    "REQUIRED",
    "AttrKind",
    "AttrSpec",
    "DataContext",
    "InferContext",
    "InputSpec",
    "OpSchema",
    "OutputSpec",
    "all_examples",
    "all_schemas",
    "get_schema",
    "register",
]
