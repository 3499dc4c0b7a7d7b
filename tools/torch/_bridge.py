"""Tensors to the NumPy kernels and back, with the op's checks built once per call signature.

A call is checked as ``geir.run`` checks the same op: its schema's rules on the shapes, dtypes and attributes
(``GraphError`` with the rule id), then its data rules on the values (``ExecutionError``). The rules run through a
one-node graph built the first time a (dtypes, shapes, attributes) key is seen and kept (``prepare``); later calls
with that key cost a dict lookup, the data rules and the kernel. float64, the kernels' test path (gradcheck), is
checked as float32 (the rules read only shapes), or as the input's first float dtype where it takes no float32
(SparseFlashAttention's float16), and computed in float64.

CPU tensors only: they are viewed as NumPy arrays without a copy (bfloat16 through an int16 view), and results
come back the same way (``torch.from_numpy``). A tensor on another device is an ``ExecutionError`` until a GPU
path exists.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from ...ir._core import Node
from ...ir._dtypes import as_dtype
from ...ir._errors import ExecutionError, GraphError, SourceLocation
from ...ir._schema import OpSchema
from ...runtimes.numpy._kernels import kernel_for
from ...schemas import DataContext
from ..builder import GraphBuilder

__all__ = ["Prepared", "call", "caller_location", "missing_tensor", "prepare", "signature_key", "to_numpy", "to_torch"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_TORCH_BF16 = torch.bfloat16
_F64 = np.dtype(np.float64)
MAX_PREPARED = 4096
"""Call signatures kept (the cache is emptied when full)."""


def missing_tensor(name: str, op: str = "geir.torch") -> GraphError:
    """The error for None given for the required Tensor argument ``name`` (torch's dispatcher lets it through)."""
    return GraphError(f"{op}: input '{name}': expected a tensor, got None (it is not optional)",
                      node=None if op == "geir.torch" else op, location=caller_location())


def to_numpy(tensor: torch.Tensor, name: str) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (no copy; strides kept); ExecutionError for any other device, GraphError
    for None (torch's dispatcher lets None through for a required Tensor argument)."""
    if tensor is None:
        raise missing_tensor(name)
    if not tensor.is_cpu:
        raise ExecutionError(f"geir.torch: '{name}' is a {tensor.device.type} tensor ({tensor.device}): geir computes "
                             "on the CPU only (no GPU path yet); move it with .cpu()")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype is _TORCH_BF16:
        return tensor.view(torch.int16).numpy().view(_BF16)
    return tensor.numpy()


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (bfloat16 included)."""
    if array.dtype == _BF16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


@dataclass(frozen=True)
class Prepared:
    """One checked call signature: the op's node (for its data rules), its kernel and its attributes."""

    node: Node
    kernel: Callable[..., Any]
    attributes: dict[str, Any]
    quiet_kernel: Callable[..., Any]
    """``kernel`` under ``np.errstate(all="ignore")`` (inf and NaN are IEEE results, as the NumPy runtime gives
    them), wrapped once: the decorator form makes no context-manager object per call and is safe across threads."""
    data_rules: Callable[[Sequence[np.ndarray | None]], None] | None
    """The op's data rules on a call's arrays, as ``validate_node_data`` runs them on host arrays (the same
    ``validate`` on the same ``DataContext``) with the node's schema looked up once; None for an op without."""


_PREPARED: dict[tuple[Any, ...], Prepared] = {}


def signature_key(schema: OpSchema, arrays: Sequence[np.ndarray | None],
                  attributes: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a call's checks depend on: the op, each input's dtype and shape (or its absence), the attributes.

    A flat tuple built in one loop: this runs on every call, and nested generator expressions cost three times as
    much. Lists (unhashable) become tuples; attribute names are in it, so an attribute left out is told apart."""
    key: list[Any] = [schema.op_type]
    for a in arrays:
        key.append(None if a is None else (a.dtype, a.shape))
    for name, value in attributes.items():
        key.append(name)
        key.append(tuple(value) if type(value) is list else value)
    return tuple(key)


def prepare(schema: OpSchema, arrays: Sequence[np.ndarray | None], attributes: Mapping[str, Any]) -> Prepared:
    """The checked signature of a call of ``schema`` on arrays of these dtypes and shapes (GraphError if a rule of
    the op refuses it; a warning rule warns on the first call only, as a graph warns when built once)."""
    key = signature_key(schema, arrays, attributes)
    found = _PREPARED.get(key)
    if found is not None:
        return found
    try:
        node = _one_node_graph(schema, arrays, attributes)
    except GraphError as exc:   # built inside torch's dispatcher: point at the caller's line, not torch's
        raise GraphError(exc.message, rule=exc.rule, node=exc.node, location=caller_location()) from None
    kernel = kernel_for(schema)
    assert kernel is not None, schema.op_type
    if len(_PREPARED) >= MAX_PREPARED:
        _PREPARED.clear()
    attributes = dict(node.attributes)
    prepared = _PREPARED[key] = Prepared(node, kernel, attributes, np.errstate(all="ignore")(kernel),
                                         _data_rules(node, attributes))
    return prepared


def _data_rules(node: Node, attributes: dict[str, Any]) -> Callable[[Sequence[np.ndarray | None]], None] | None:
    schema = node.schema
    validate = schema.validate
    if validate is None:
        return None
    name, location = node.name, node.location
    return lambda arrays: validate(DataContext(schema, name, arrays, attributes, location=location))


def _one_node_graph(schema: OpSchema, arrays: Sequence[np.ndarray | None], attributes: Mapping[str, Any]) -> Node:
    """The op's node, built and verified on these dtypes and shapes (float64 as float32, or as the input's first
    float dtype) and attributes."""
    b = GraphBuilder(f"geir.torch.{schema.op_type}")
    values = [None if a is None else b.input(spec.name, _checked_as(spec.dtypes, a.dtype), a.shape)
              for spec, a in zip(schema.inputs, arrays)]
    result = b.add_node(schema, values, {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()},
                        name=schema.op_type)
    results = result if isinstance(result, tuple) else (result,)
    for spec, value in zip(schema.outputs, results):
        if value is not None:
            b.output(value, "out_" + spec.name)
    return b.build().nodes[0]


def _checked_as(allowed: Sequence[Any], dtype: np.dtype) -> Any:
    if dtype != _F64:
        return as_dtype(dtype)
    f32 = as_dtype(np.float32)
    if f32 in allowed:
        return f32
    return next((d for d in allowed if np.issubdtype(np.dtype(d.numpy), np.floating)), f32)


def caller_location() -> SourceLocation | None:
    """The innermost frame outside geir and torch: the line that called the ``geir.torch`` function."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not any(module == top or module.startswith(top + ".") for top in ("geir", "torch")):
            return SourceLocation(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


def call(schema: OpSchema, arrays: Sequence[np.ndarray | None], attributes: Mapping[str, Any],
         **extra: Any) -> Any:
    """Check and run ``schema``'s NumPy kernel on ``arrays`` (``extra``: ``out=`` for the in-place ops)."""
    prepared = _PREPARED.get(signature_key(schema, arrays, attributes)) or prepare(schema, arrays, attributes)
    if prepared.data_rules is not None:
        prepared.data_rules(arrays)
    try:
        return prepared.quiet_kernel(*arrays, **prepared.attributes, **extra)
    except ExecutionError:
        raise
    except Exception as exc:
        node = prepared.node
        raise ExecutionError(f"While executing {node.op_type} (geir.torch): {type(exc).__name__}: {exc}",
                             node=node.name) from exc
