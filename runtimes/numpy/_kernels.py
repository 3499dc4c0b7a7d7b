"""The NumPy kernels' registration: each kernel registers itself against the schema it implements, into the
registry of every backend (``runtimes._kernels``) under the NumPy backend's name.

Kernels take the node's inputs positionally (None for absent ones) and its attributes by keyword;
ops with an aliased output also take ``out=`` (a buffer the runtime owns, possibly the aliased input
itself). A kernel may also take ``outputs=``: the caller's buffers by output index (None where it
gave none), which it writes and returns instead of allocating. They return one array or a tuple in
output order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from ...schemas import OpSchema
from .._kernels import kernel_for as _kernel_for
from .._kernels import Kernel, kernel_table, register_kernel
from . import _pool as pool
from ._arrays import NUMPY

__all__ = ["KERNELS", "Kernel", "kernel", "kernel_for", "output_buffer", "take_rows"]

K = TypeVar("K", bound=Kernel)

KERNELS: dict[tuple[str, str], Kernel] = kernel_table(NUMPY)
"""(domain, op type) of a schema -> its NumPy kernel: the NumPy backend's live table in ``runtimes._kernels``."""


def kernel(schema: OpSchema) -> Callable[[K], K]:
    """Register the decorated function as the NumPy kernel of ``schema``.

    Its signature must be the schema's: the inputs positionally, by their GE IR names and in order;
    every attribute by keyword with the declared default (none where the attribute is required);
    ``out`` when an output aliases an input. A mismatch is a TypeError at import, so an attribute
    added to a declaration cannot be forgotten by its kernel."""
    def register(fn: K) -> K:
        _check_signature(schema, fn)
        register_kernel(NUMPY, schema.domain, schema.op_type, fn)
        return fn
    return register


def _check_signature(schema: OpSchema, fn: Kernel) -> None:
    params = inspect.signature(fn).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    wanted = {a.name: (inspect.Parameter.empty if a.required else a.default) for a in schema.attributes}
    if any(o.alias is not None for o in schema.outputs):
        wanted["out"] = None
    if "outputs" in keywords:
        wanted["outputs"] = None
    problems = []
    if positional != list(schema.input_names):
        problems.append(f"inputs {positional}, expected {list(schema.input_names)}")
    for name in sorted(set(wanted) | set(keywords)):
        if name not in keywords:
            problems.append(f"no keyword '{name}'")
        elif name not in wanted:
            problems.append(f"keyword '{name}' is not an attribute of the schema")
        elif keywords[name] != wanted[name]:
            shown = "none (required)" if wanted[name] is inspect.Parameter.empty else repr(wanted[name])
            problems.append(f"'{name}' defaults to {keywords[name]!r}, the declaration to {shown}")
    if problems:
        raise TypeError(f"NumPy kernel {fn.__qualname__} of {schema.op_type}: " + "; ".join(problems))


def kernel_for(schema: OpSchema) -> Kernel | None:
    """The NumPy kernel of ``schema``, or None (standard ops run on onnx.reference instead)."""
    return _kernel_for(NUMPY, schema.domain, schema.op_type)


def output_buffer(outputs: tuple[np.ndarray | None, ...] | None, index: int, shape: tuple[int, ...],
                  dtype: np.dtype) -> np.ndarray:
    """The caller's buffer for output ``index`` if it gave one (checked by the runtime), else a new array
    (from memory earlier runs let go of, ``_pool``)."""
    buffer = outputs[index] if outputs is not None and index < len(outputs) else None
    return buffer if buffer is not None else pool.empty(shape, dtype)


def take_rows(table: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = table[rows]`` along axis 0, written straight into ``out``.

    ``mode="clip"`` is for speed, not for safety: with the default ``"raise"`` NumPy gathers into a
    hidden copy of ``out`` and copies it back (3-4x the time at the MoE and attention shapes). Callers
    pass rows that are already validated or clamped; clipping only keeps a bug memory-safe."""
    return np.take(table, rows, axis=0, out=out, mode="clip")
