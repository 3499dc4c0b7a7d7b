"""Validation of the arrays fed to a graph: names, dtypes, ranks, dims and symbol bindings."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..ir._core import Graph
from ..ir._errors import ExecutionError

__all__ = ["as_feed_array", "validate_feeds"]


def as_feed_array(feed: object, where: str) -> np.ndarray:
    """A NumPy array of the values fed, converted where that is exact: PyTorch tensors (also bfloat16, ones
    that require grad, detached, and negative or conjugate views, resolved), arrays of non-native byte order.
    ExecutionError otherwise (a sparse, meta or other tensor without plain strided data, say)."""
    if type(feed).__module__.split(".")[0] == "torch" and hasattr(feed, "detach"):
        feed = _tensor_as_array(feed, where)
    try:
        array = np.asarray(feed)
    except Exception as exc:
        raise ExecutionError(f"{where}: cannot be read as an array ({type(feed).__name__}: {exc})") from None
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return array


def _tensor_as_array(feed: object, where: str) -> np.ndarray:
    """A PyTorch tensor's values as a NumPy array (torch is imported lazily: it is optional for geir)."""
    import torch

    tensor = feed.detach()  # type: ignore[attr-defined]
    if tensor.layout != torch.strided:
        raise ExecutionError(f"{where}: a torch tensor of layout {tensor.layout} is not a dense array; convert it "
                             f"with .to_dense() first")
    if tensor.is_meta:
        raise ExecutionError(f"{where}: a torch tensor on the meta device has no data to run on")
    try:
        tensor = tensor.cpu().resolve_neg().resolve_conj()   # a negative or conjugate view: the values it means
        if tensor.dtype == torch.bfloat16:   # NumPy has no bfloat16: reinterpret the bits
            import ml_dtypes

            return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    except Exception as exc:   # a quantized, nested or other tensor NumPy cannot hold
        raise ExecutionError(f"{where}: cannot be read as an array (a torch tensor of dtype {tensor.dtype}: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def _static_inputs(graph: Graph) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...] | None:
    """(name, dtype, shape) of every input when no input dim is a symbol, else None; kept in ``Graph.compiled``
    with the executables, so an edit (a new revision) drops it with them."""
    key = ("feeds", "static inputs")
    if key not in graph.compiled:
        static = all(v.type.is_static for v in graph.inputs)
        graph.compiled[key] = tuple((v.name, v.type.dtype.numpy, tuple(v.type.shape)) for v in graph.inputs) \
            if static else None
    return graph.compiled[key]  # type: ignore[return-value]


def _exact_feeds(graph: Graph, feeds: Mapping[str, object]) -> dict[str, np.ndarray] | None:
    """The feeds as they are when every one is a NumPy array of exactly the input's dtype and static shape and
    nothing else is fed (the common case, checked in a few comparisons); None sends them to the full check."""
    inputs = _static_inputs(graph)
    if inputs is None or len(feeds) != len(inputs):
        return None
    arrays = {}
    for name, dtype, shape in inputs:
        feed = feeds.get(name)
        if type(feed) is not np.ndarray or feed.dtype != dtype or feed.shape != shape:
            return None
        arrays[name] = feed
    return arrays


def validate_feeds(graph: Graph, feeds: Mapping[str, object]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Check feeds against the graph inputs; return the arrays and the symbol bindings.

    An input not fed takes its default (``Graph.defaults``) when it has one.
    Raises ExecutionError naming the input for a missing or unexpected feed, a wrong dtype
    (no silent casts), a wrong rank or dim, or a symbol bound to two different sizes.
    """
    if not isinstance(feeds, Mapping):
        raise ExecutionError(f"graph '{graph.name}': feeds: expected a mapping of input name -> array (a dict), got "
                             f"{type(feeds).__name__}")
    exact = _exact_feeds(graph, feeds)
    if exact is not None:
        return exact, {}
    expected = {v.name for v in graph.inputs}
    unexpected = sorted(map(str, set(feeds) - expected))
    if unexpected:
        raise ExecutionError(f"graph '{graph.name}': unexpected feed(s) {unexpected}; inputs are "
                             f"{sorted(expected)}")
    arrays: dict[str, np.ndarray] = {}
    bindings: dict[str, tuple[int, str]] = {}
    for value in graph.inputs:
        where = f"graph '{graph.name}': input '{value.name}'"
        if value.name in feeds:
            array = as_feed_array(feeds[value.name], where)
        elif value.name in graph.defaults:    # an overridable default, used when the input is not fed
            array, where = graph.defaults[value.name], f"{where} (its default)"
        else:
            raise ExecutionError(f"graph '{graph.name}': input '{value.name}' ({value.type}) is not fed")
        want = value.type
        if array.dtype != want.dtype.numpy:
            raise ExecutionError(f"{where}: expected dtype {want.dtype}, got {array.dtype}; cast the array first")
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
