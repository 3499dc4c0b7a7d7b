"""ONNX lowerings: for each op, a function that writes the standard-op body of its FunctionProto.

A lowering gets a ``LoweringSpec``: which optional inputs the model's nodes of that op
provide, and the structural attributes bodies are specialised on (layouts, modes). Numeric
attributes stay reference attributes of the function. One lowering per op type, registered
by the op family's lowering module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._onnx_body import Body
from ._registry import Slot
from ._schema import OpSchema

__all__ = ["LOWERINGS", "LoweringSpec", "register_lowering"]


@dataclass(frozen=True)
class LoweringSpec:
    op_type: str
    present: frozenset[str]
    """Names of the optional inputs the nodes provide (required inputs are always there)."""
    structure: tuple[tuple[str, Any], ...] = ()
    """Attributes the body is specialised on, as (name, value) pairs."""
    inputs: tuple[str, ...] = ()
    """Formal names of the function's inputs (the schema's input names)."""
    schema_outputs: tuple[str, ...] = ()

    @property
    def outputs(self) -> tuple[str, ...]:
        """Formal names of the function's outputs: the schema's, renamed where they clash with an input."""
        return tuple(self.out(name) for name in self.schema_outputs)

    def has(self, name: str) -> bool:
        return name in self.present

    def out(self, name: str) -> str:
        """The formal output name for the schema output ``name``."""
        return name + "_out" if name in self.inputs else name

    def attr(self, name: str) -> Any:
        return dict(self.structure)[name]


Lowering = Callable[[Body, LoweringSpec], None]
LOWERINGS: Slot[tuple[Lowering, tuple[str, ...]]] = Slot("ONNX lowerings")
"""(domain, op type) of a schema -> (body writer, the attributes the body is specialised on)."""


def register_lowering(schema: OpSchema, structural_attributes: tuple[str, ...] = ()) -> Callable[[Lowering], Lowering]:
    """Register the body writer of ``schema``; ``structural_attributes`` change the body's shape."""
    def decorate(fn: Lowering) -> Lowering:
        LOWERINGS.register(schema.domain, schema.op_type, (fn, structural_attributes))
        return fn
    return decorate
