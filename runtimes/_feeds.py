"""Validation of the arrays fed to a graph: names, dtypes, ranks, dims and symbol bindings.

Written against the array protocol (``runtimes._arrays``): the runtime's backend converts each feed to one of its
arrays and says its dtype; this module knows no array library."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..ir._core import Graph
from ..ir._dtypes import DType
from ..ir._errors import ExecutionError
from ..ir._types import TensorType

from ._arrays import Array, ArrayBackend, host_backend

__all__ = ["validate_feeds"]


def _static_inputs(graph: Graph) -> tuple[tuple[str, DType, tuple[int, ...]], ...] | None:
    """(name, dtype, shape) of every input when no input dim is a symbol, else None; kept in ``Graph.compiled``
    with the executables, so an edit (a new revision) drops it with them."""
    key = ("feeds", "static inputs")
    if key not in graph.compiled:
        static = all(v.type.is_static for v in graph.inputs)
        graph.compiled[key] = tuple((v.name, v.type.dtype, tuple(v.type.shape)) for v in graph.inputs) \
            if static else None
    return graph.compiled[key]  # type: ignore[return-value]


def _exact_feeds(graph: Graph, feeds: Mapping[str, object], backend: ArrayBackend[Any]
                 ) -> dict[str, Array] | None:
    """The feeds as they are when every one is a plain array of the backend of exactly the input's dtype and static
    shape and nothing else is fed (the common case, checked in a few comparisons); None sends them to the full
    check."""
    inputs = _static_inputs(graph)
    if inputs is None or len(feeds) != len(inputs):
        return None
    array_type, dtype_of = backend.array_type, backend.dtype_of
    arrays: dict[str, Array] = {}
    for name, dtype, shape in inputs:
        feed = feeds.get(name)
        if type(feed) is not array_type or dtype_of(feed) is not dtype or feed.shape != shape:  # type: ignore
            return None
        arrays[name] = feed  # type: ignore[assignment]
    return arrays


def _non_tensor_feed(feed: object, want: TensorType, backend: ArrayBackend[Any], where: str) -> Any:
    """A sequence feed (a list or tuple of arrays, each of the element dtype) as a list; an optional one may be
    None (absent)."""
    if feed is None and want.kind.startswith("optional"):
        return None
    if want.kind in ("sequence", "optional_sequence"):
        if not isinstance(feed, (list, tuple)):
            raise ExecutionError(f"{where}: expected a list of arrays ({want}), got {type(feed).__name__}")
        items = [backend.as_array(item, f"{where} item {k}") for k, item in enumerate(feed)]
    else:
        items = [backend.as_array(feed, where)]
    for k, item in enumerate(items):
        if backend.dtype_of(item) is not want.dtype:
            raise ExecutionError(f"{where}: item {k}: expected dtype {want.dtype}, got {backend.dtype_name(item)}")
    return items if want.kind in ("sequence", "optional_sequence") else items[0]


def validate_feeds(graph: Graph, feeds: Mapping[str, object], backend: ArrayBackend[Any] | None = None
                   ) -> tuple[dict[str, Array], dict[str, int]]:
    """Check feeds against the graph inputs; return the backend's arrays and the symbol bindings.

    ``backend`` converts the feeds (``ArrayBackend.as_array``) and input defaults (``from_host``); NumPy's when not
    given. An input not fed takes its default (``Graph.defaults``) when it has one.
    Raises ExecutionError naming the input for a missing or unexpected feed, a wrong dtype
    (no silent casts), a wrong rank or dim, or a symbol bound to two different sizes.
    """
    if backend is None:
        backend = host_backend()
    if not isinstance(feeds, Mapping):
        raise ExecutionError(f"graph '{graph.name}': feeds: expected a mapping of input name -> array (a dict), got "
                             f"{type(feeds).__name__}")
    exact = _exact_feeds(graph, feeds, backend)
    if exact is not None:
        return exact, {}
    expected = {v.name for v in graph.inputs}
    unexpected = sorted(map(str, set(feeds) - expected))
    if unexpected:
        raise ExecutionError(f"graph '{graph.name}': unexpected feed(s) {unexpected}; inputs are "
                             f"{sorted(expected)}")
    arrays: dict[str, Array] = {}
    bindings: dict[str, tuple[int, str]] = {}
    for value in graph.inputs:
        where = f"graph '{graph.name}': input '{value.name}'"
        if not value.type.is_tensor:
            if value.name not in feeds and not value.type.kind.startswith("optional"):
                raise ExecutionError(f"graph '{graph.name}': input '{value.name}' ({value.type}) is not fed")
            arrays[value.name] = _non_tensor_feed(feeds.get(value.name), value.type, backend, where)
            continue
        if value.name in feeds:
            array = backend.as_array(feeds[value.name], where)
        elif value.name in graph.defaults:    # an overridable default, used when the input is not fed
            array, where = backend.from_host(graph.defaults[value.name]), f"{where} (its default)"
        else:
            raise ExecutionError(f"graph '{graph.name}': input '{value.name}' ({value.type}) is not fed")
        want = value.type
        if backend.dtype_of(array) is not want.dtype:
            raise ExecutionError(f"{where}: expected dtype {want.dtype}, got {backend.dtype_name(array)}; cast the "
                                 f"array first")
        if want.dims is None:          # any rank: the first node reading it checks what it needs
            arrays[value.name] = array
            continue
        if array.ndim != want.rank:
            raise ExecutionError(f"{where}: expected rank {want.rank} {list(want.shape)}, got rank {array.ndim} "
                                 f"{list(array.shape)}")
        for k, (dim, size) in enumerate(zip(want.shape, array.shape)):
            if isinstance(dim, int):
                if dim != size:
                    raise ExecutionError(f"{where} dim {k}: expected {dim}, got {size} (shape {list(array.shape)})")
                continue
            key = graph.symbols.canonical(dim)
            if key in bindings and bindings[key][0] != size:
                first, owner = bindings[key]
                raise ExecutionError(f"{where} dim {k}: symbol '{dim}' is {size} here but {first} in {owner}")
            bindings.setdefault(key, (size, f"input '{value.name}' dim {k}"))
        arrays[value.name] = array
    return arrays, {sym: size for sym, (size, _) in bindings.items()}
