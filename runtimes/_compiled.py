"""Executables kept per graph revision, and the check that a graph has not changed since it was compiled.

Both runtimes compile a graph once per revision (``Graph.revision``, bumped by every edit): ``compile`` on the
same unchanged graph returns the executable it made before, so ``geir.run`` in a loop neither schedules nor
exports again. The executable lives in ``Graph.compiled``, so it is freed with its graph (a global table keyed by
the graph would keep every graph alive through the executable's reference to it). An executable run after its
graph was edited raises instead of running what the graph no longer says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..ir._core import Graph
from ..ir._errors import ExecutionError, GraphError

__all__ = ["compiled_once", "ensure_built", "ensure_current"]

E = TypeVar("E")


def ensure_built(graph: Graph) -> None:
    """GraphError unless ``graph`` is verified and typed (built, and not edited since)."""
    if not {"verified", "typed"} <= graph.properties:
        raise GraphError(f"graph '{graph.name}' is not built; call GraphBuilder.build() first")


def compiled_once(graph: Graph, key: object, make: Callable[[Graph], E], runtime: str) -> E:
    """The executable ``make(graph)`` of this revision of ``graph`` under ``key`` (made on first use)."""
    ensure_built(graph)
    found = graph.compiled.get((runtime, key))
    if found is None:
        found = graph.compiled[(runtime, key)] = make(graph)
    return found  # type: ignore[return-value]


def ensure_current(graph: Graph, revision: int, runtime: str) -> None:
    """ExecutionError when ``graph`` was edited after an executable was compiled from it at ``revision``."""
    if graph.revision != revision:
        raise ExecutionError(f"graph '{graph.name}' was edited after it was compiled for {runtime}: this executable "
                             f"runs what the graph no longer says; build the graph again and compile it anew")
