"""Ops of domains neither geir nor ``onnx.defs`` declares: ONNX Runtime's contrib ops (``com.microsoft``:
RotaryEmbedding, GroupQueryAttention, SkipLayerNormalization, ... as its optimizer writes them), say.

geir cannot check or infer such an op, so it takes a node of one as the file states it: any inputs, the node's
outputs, its attributes unchecked, and the output types the file declares (its value_info; ``Node.declared``).
An output the file leaves untyped is a GraphError. The ONNX Runtime runtime runs the node (when its engine has
the op); the NumPy runtime has no kernel for it and says so.
"""

from __future__ import annotations

from typing import Any

from ._dtypes import DType
from ._errors import GraphError, SourceLocation
from ._schema import InferContext, InputSpec, OutputSpec
from ._standard import OpAdapter
from ._types import TensorType

__all__ = ["ForeignOpSchema", "foreign_schema"]

_CACHE: dict[tuple[str, str, int, int], ForeignOpSchema] = {}


class ForeignOpSchema(OpAdapter):
    """An op geir knows only by its name and what a file declares of its outputs."""

    validate = None
    validated_inputs: tuple[str, ...] = ()
    exact_across_runtimes = False
    attributes: tuple = ()
    variadic = True          # each node has its own output count
    holds_subgraphs = False
    max_inputs = 2**31 - 1

    def __init__(self, op_type: str, domain: str, outputs: int, version: int) -> None:
        self.op_type, self.domain, self.version = op_type, domain, version
        self.doc = (f"{domain}::{op_type}, an op geir knows only by name: its output types are those the model file "
                    f"declares")
        self.inputs = (InputSpec("inputs", tuple(DType), optional=True),)
        self.outputs = tuple(OutputSpec(f"output_{i}", optional=True) for i in range(outputs))

    @property
    def input_names(self) -> tuple[str, ...]:
        return ("inputs",)

    def input_index(self, key: int | str) -> int:
        if isinstance(key, int):
            return key
        raise GraphError(f"{self.domain}::{self.op_type}: its inputs have no names geir knows; pass them by position")

    def bind_attributes(self, given: dict[str, Any], node: str, location: SourceLocation | None = None) -> dict:
        return dict(given)

    def check_signature(self, input_types, node: str, location: SourceLocation | None = None) -> None:
        return None

    def infer_types(self, ctx: InferContext) -> tuple[TensorType | None, ...]:
        declared = list(ctx.declared or ())
        types = tuple(declared[i] if i < len(declared) else None for i in range(len(self.outputs)))
        missing = [i for i, t in enumerate(types) if t is None]
        if missing:
            raise GraphError(f"{self.domain}::{self.op_type} '{ctx.node}': output {missing[0]}: geir neither declares "
                             f"nor infers ops of domain '{self.domain}', and the model declares no type for it (give "
                             f"the model value_info for every output of such a node)", node=ctx.node,
                             location=ctx.location)
        return types


def foreign_schema(op_type: str, domain: str, outputs: int | None, version: int | None) -> ForeignOpSchema:
    key = (op_type, domain, outputs or 1, version or 1)
    if key not in _CACHE:
        _CACHE[key] = ForeignOpSchema(op_type, domain, outputs or 1, version or 1)
    return _CACHE[key]
