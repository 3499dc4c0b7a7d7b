"""Pass infrastructure: a pass states what it requires and ensures; a manager runs a sequence."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

from ..ir._core import Graph
from ..ir._errors import GraphError

__all__ = ["Pass", "PassManager", "PassResult"]


class PassResult(NamedTuple):
    graph: Graph
    modified: bool


class Pass(ABC):
    """One transformation or analysis of a graph, in place.

    ``requires``: graph properties that must hold before (set by earlier passes); ``ensures``:
    properties that hold on the graph the pass returns. A pass that modifies the graph keeps only
    the properties listed in ``preserves`` (plus its own ``ensures``); the others are cleared.
    """

    requires: ClassVar[frozenset[str]] = frozenset()
    ensures: ClassVar[frozenset[str]] = frozenset()
    preserves: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def call(self, graph: Graph) -> PassResult: ...

    def __call__(self, graph: Graph) -> PassResult:
        missing = self.requires - graph.properties
        if missing:
            remedy = ("the graph is not built: call GraphBuilder.build() first" if missing <= {"verified", "typed"}
                      else "run the passes that ensure them first")
            raise GraphError(f"pass {type(self).__name__} requires {sorted(missing)} on graph '{graph.name}'; {remedy}")
        before = set(graph.properties)
        result = self.call(graph)
        returned = result.graph
        if result.modified:
            returned.invalidate()          # a new revision: what was compiled from the old one is stale
            returned.properties = before & self.preserves
        returned.properties |= self.ensures
        return result


class PassManager:
    """Runs passes in order; the result is modified if any pass modified the graph."""

    def __init__(self, passes: Sequence[Pass]) -> None:
        self.passes = list(passes)

    def __call__(self, graph: Graph) -> PassResult:
        modified = False
        for p in self.passes:
            graph, changed = p(graph)
            modified |= changed
        return PassResult(graph, modified)
