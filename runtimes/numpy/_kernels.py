"""The NumPy kernel registry: each kernel registers itself against the schema it implements.

Kernels take the node's inputs positionally (None for absent ones) and its attributes by keyword;
ops with an aliased output also take ``out=`` (a buffer the runtime owns, possibly the aliased input
itself). They return one array or a tuple in output order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ...schemas import OpSchema
from ...schemas._registry import register_for

__all__ = ["KERNELS", "Kernel", "kernel", "kernel_for"]

Kernel = Callable[..., object]
K = TypeVar("K", bound=Kernel)

KERNELS: dict[tuple[str, str], Kernel] = {}
"""(domain, op type) of a schema -> its NumPy kernel."""


def kernel(schema: OpSchema) -> Callable[[K], K]:
    """Register the decorated function as the NumPy kernel of ``schema``."""
    def register(fn: K) -> K:
        register_for(KERNELS, schema, fn, "NumPy kernels")
        return fn
    return register


def kernel_for(schema: OpSchema) -> Kernel | None:
    """The NumPy kernel of ``schema``, or None (standard ops run on onnx.reference instead)."""
    return KERNELS.get((schema.domain, schema.op_type))
