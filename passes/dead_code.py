"""EliminateDeadCode: remove nodes that no graph output depends on."""

from __future__ import annotations

import networkx as nx

from ..ir._core import Graph, Node

from ._infra import Pass, PassResult

__all__ = ["EliminateDeadCode", "drop_unused_constants", "live_nodes"]


def live_nodes(graph: Graph) -> set[Node]:
    """The nodes some graph output depends on (ancestors of the output producers)."""
    dag = graph.to_networkx()
    roots = {v.producer for v in graph.outputs if v.producer is not None}
    live = set(roots)
    for node in roots:
        live |= nx.ancestors(dag, node)
    return live


class EliminateDeadCode(Pass):
    """Our ops have no side effects, so a node is dead when no graph output depends on it."""

    requires = frozenset({"verified"})
    preserves = frozenset({"verified", "typed"})   # removing unused nodes keeps both true

    def call(self, graph: Graph) -> PassResult:
        live = live_nodes(graph)
        dead = [n for n in graph.nodes if n not in live]
        for node in dead:
            node.graph = None                 # detached first: their unlinking changes nothing live
            for i in range(len(node.inputs)):
                node.set_input(i, None)
        graph.nodes = [n for n in graph.nodes if n in live]
        return PassResult(graph, bool(dead))


def drop_unused_constants(graph: Graph, prefix: str = "") -> None:
    """Remove the constants (named with ``prefix``) that no node reads and that are not graph outputs: what a
    rewrite left behind (slice bounds, axes) or never used."""
    outputs = {id(v) for v in graph.outputs}
    for value in [v for v in graph.constant_values if v.name.startswith(prefix) and not v.uses
                  and id(v) not in outputs]:
        graph.constant_values.remove(value)
        del graph.constants[value.name]
