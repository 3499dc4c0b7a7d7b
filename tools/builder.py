"""GraphBuilder: the user's way to build a graph, the way CANN's graph mode does.

It is the ground floor's ``GraphEditor`` (one method per registered op, each node checked as it is added)
plus ``build()``, which runs the verification passes and hands back the built graph.
"""

from __future__ import annotations

from ..ir._core import Graph
from ..ir._editor import GraphEditor
from ..passes import build_pipeline

__all__ = ["GraphBuilder"]


class GraphBuilder(GraphEditor):
    """Accumulates inputs, nodes and outputs; ``build()`` verifies and returns the Graph."""

    def build(self) -> Graph:
        """Verify the graph and infer every type (raises GraphError); the builder is then closed."""
        graph, _ = build_pipeline()(self.finish())
        return graph
