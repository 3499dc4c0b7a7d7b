"""Caller-provided output buffers (``Executable.run(feeds, outputs={name: array})``), checked once for
both runtimes: a loop that reuses its buffers pays no allocation or page faults for them.

A buffer must be a writeable, C-contiguous array of the runtime's backend (``runtimes._arrays``; for the NumPy
runtime a NumPy array) of the output's dtype and shape, share memory
with no other buffer, with no graph constant or input default (the graph's own: a run writing there
would change the graph), and with no feed, except the feed an in-place op overwrites anyway (the
output aliases that input and the feed has no other reader), which is how a caller asks for a true
in-place run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..ir._core import Graph, Value
from ..ir._errors import ExecutionError

from ._arrays import Array, ArrayBackend, host_backend

__all__ = ["concrete_shape", "fill_output_buffers", "validate_output_buffers"]


def concrete_shape(graph: Graph, value: Value, bindings: Mapping[str, int]) -> tuple[int, ...] | None:
    """The value's shape with its symbols bound by the feeds; None while a dim is data-dependent."""
    if value.type.dims is None:
        return None
    dims = [d if isinstance(d, int) else bindings.get(graph.symbols.canonical(d)) for d in value.type.dims]
    return None if any(d is None for d in dims) else tuple(dims)


def _overwrites_feed(value: Value, feed: str) -> bool:
    """Whether ``value`` is produced in place over graph input ``feed``, its only reader."""
    node = value.producer
    if node is None:
        return False
    alias = node.schema.outputs[value.index].alias
    source = node.inputs[alias] if alias is not None else None
    return source is not None and source.producer is None and source.name == feed and len(source.uses) == 1


def validate_output_buffers(graph: Graph, buffers: Mapping[str, Any] | None, feeds: Mapping[str, Array],
                            bindings: Mapping[str, int], given: Mapping[str, object] | None = None,
                            backend: ArrayBackend[Any] | None = None) -> dict[str, Array]:
    """The checked buffers by output name; ExecutionError naming the output and what is wrong.

    ``feeds`` are the arrays a run reads (``validate_feeds``), ``given`` the feeds as the caller passed them (an
    array of another byte order is read from a copy, yet the caller's array must not be written either);
    ``backend`` answers for the arrays (NumPy's when not given)."""
    if buffers is None:
        return {}
    if backend is None:
        backend = host_backend()
    if not isinstance(buffers, Mapping):
        raise ExecutionError(f"graph '{graph.name}': outputs: expected a mapping of output name -> array, got "
                             f"{type(buffers).__name__}")
    by_name = {v.name: v for v in graph.outputs}
    shares = backend.may_share_memory
    checked: dict[str, Array] = {}
    for name, buffer in buffers.items():
        if name not in by_name:
            raise ExecutionError(f"graph '{graph.name}': outputs: {name!r} is not a graph output (outputs: "
                                 f"{', '.join(by_name)})")
        value, where = by_name[name], f"graph '{graph.name}': output buffer '{name}'"
        if not value.type.is_tensor:
            raise ExecutionError(f"{where}: the output is a {value.type}, not a tensor: it takes no buffer")
        if not backend.is_array(buffer):
            raise ExecutionError(f"{where}: expected {backend.kind}, got {type(buffer).__name__}")
        if backend.dtype_of(buffer) is not value.dtype:
            raise ExecutionError(f"{where}: expected dtype {value.dtype}, got {backend.dtype_name(buffer)}")
        shape = concrete_shape(graph, value, bindings)
        if (shape is not None and buffer.shape != shape) or buffer.ndim != value.type.rank:
            raise ExecutionError(f"{where}: expected shape {list(shape) if shape else list(value.type.shape)}, got "
                                 f"{list(buffer.shape)}")
        if not backend.is_writeable_contiguous(buffer):
            raise ExecutionError(f"{where}: expected a writeable C-contiguous array ({backend.empty_example} is one)")
        _refuse_graph_memory(graph, buffer, where, backend)
        for feed, array in feeds.items():
            raw = (given or {}).get(feed)
            if (shares(buffer, array) and not (buffer is array and _overwrites_feed(value, feed))) or (
                    backend.is_array(raw) and raw is not array and shares(buffer, raw)):
                raise ExecutionError(f"{where}: shares memory with feed '{feed}'; only the feed an in-place op "
                                     "overwrites (its only reader) may be its own output buffer")
        for other, earlier in checked.items():
            if shares(buffer, earlier):
                raise ExecutionError(f"{where}: shares memory with the buffer of output '{other}'")
        checked[name] = buffer
    return checked


def _refuse_graph_memory(graph: Graph, buffer: Array, where: str, backend: ArrayBackend[Any]) -> None:
    """ExecutionError when ``buffer`` shares memory with a graph constant or input default (host arrays)."""
    for kind, arrays in (("constant", graph.constants), ("default of input", graph.defaults)):
        for name, array in arrays.items():
            if backend.may_share_memory(buffer, array):
                raise ExecutionError(f"{where}: shares memory with graph {kind} '{name}'; a run must not write into "
                                     f"the graph (give a buffer of its own, e.g. {backend.empty_example})")


def fill_output_buffers(graph: Graph, results: dict[str, Array], buffers: Mapping[str, Array],
                        backend: ArrayBackend[Any] | None = None) -> None:
    """Put each result the runtime did not write in place into its buffer (checking a data-dependent shape)."""
    if buffers and backend is None:
        backend = host_backend()
    for name, buffer in buffers.items():
        result = results[name]
        if result is not buffer:
            if result.shape != buffer.shape:
                raise ExecutionError(f"graph '{graph.name}': output buffer '{name}': the output has shape "
                                     f"{list(result.shape)}, the buffer {list(buffer.shape)}")
            backend.copy_into(buffer, result)  # type: ignore[union-attr]
            results[name] = buffer
