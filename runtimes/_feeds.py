"""Validation of the arrays fed to a graph: names, dtypes, ranks, dims and symbol bindings."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from geir._core import Graph
from geir._errors import ExecutionError

__all__ = ["validate_feeds"]


def validate_feeds(graph: Graph, feeds: Mapping[str, object]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Check feeds against the graph inputs; return the arrays and the symbol bindings.

    Raises ExecutionError naming the input for a missing or unexpected feed, a wrong dtype
    (no silent casts), a wrong rank or dim, or a symbol bound to two different sizes.
    """
    expected = {v.name for v in graph.inputs}
    unexpected = sorted(set(feeds) - expected)
    if unexpected:
        raise ExecutionError(f"graph '{graph.name}': unexpected feed(s) {unexpected}; inputs are "
                             f"{sorted(expected)}")
    arrays: dict[str, np.ndarray] = {}
    bindings: dict[str, tuple[int, str]] = {}
    for value in graph.inputs:
        if value.name not in feeds:
            raise ExecutionError(f"graph '{graph.name}': input '{value.name}' ({value.type}) is not fed")
        array = np.asarray(feeds[value.name])
        want = value.type
        where = f"graph '{graph.name}': input '{value.name}'"
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
