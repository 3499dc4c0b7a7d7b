"""Rewrite standard-op subgraphs into our ops (``geir.fuse``): the patterns of ``schemas.patterns``.

Every node whose op type is a pattern's anchor is offered to that pattern, in topological order, pattern by
pattern, and again until nothing changes (patterns compose: a rope on a slice of the head dim is first a
rope, then a partial rope). A match is kept only if our op, built from it through the GraphBuilder, passes
every schema rule (a rule that fails turns the match into a near miss with the rule's message) and its
output has the type of the value it replaces; then that value's uses move to the new node, it keeps the
graph's output name, and the nodes no output needs any more are removed. The graph's interface (inputs,
outputs, their names and types) is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..ir._core import Graph
from ..ir._errors import GraphError
from ..schemas.patterns import GraphView, Match, NearMiss, patterns
from .dead_code import drop_unused_constants, live_nodes

if TYPE_CHECKING:
    from ..ir._builder import GraphBuilder

__all__ = ["FusionReport", "Fused", "Missed", "apply_patterns"]


@dataclass(frozen=True)
class Fused:
    pattern: str
    replaced: tuple[str, ...]
    """Names of the standard nodes the new node stands for."""
    became: str
    """``<OpType> '<node name>'`` of the new node."""


@dataclass(frozen=True)
class Missed:
    pattern: str
    node: str
    reason: str


@dataclass
class FusionReport:
    """What ``geir.fuse`` did: each match (pattern, nodes replaced, the op it became) and each near miss."""

    graph: str
    fused: list[Fused] = field(default_factory=list)
    near_misses: list[Missed] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"geir.fuse '{self.graph}': {len(self.fused)} fused, {len(self.near_misses)} near misses"]
        for f in self.fused:
            lines.append(f"  fused  {f.pattern}: {len(f.replaced)} nodes ({', '.join(f.replaced)}) -> {f.became}")
        for m in self.near_misses:
            lines.append(f"  missed {m.pattern} at '{m.node}': {m.reason}")
        return "\n".join(lines)


def _apply(graph: Graph, match: Match, extend: Callable[[Graph], GraphBuilder], name: str) -> Any:
    """Add our op for ``match`` (its rules checked on creation) and move the replaced value's uses to it."""
    builder = extend(graph)
    inputs = list(match.inputs)
    for index, transform in match.transforms.items():
        inputs[index] = transform(builder, inputs[index], f"{name}_convert{index}")
    for index, dtype in match.casts.items():
        inputs[index] = builder.op("Cast", inputs[index], to=dtype, name=f"{name}_cast{index}")
    for index, shape in match.reshapes.items():
        target = builder.constant(f"{name}_shape{index}", np.asarray(shape, np.int64))
        inputs[index] = builder.op("Reshape", inputs[index], target, name=f"{name}_reshape{index}")
    for index, array in match.constants.items():
        inputs[index] = builder.constant(f"{name}_input{index}", array)
    result = getattr(builder, match.op)(*inputs, name=name, **match.attributes)
    new = result[match.output_index] if isinstance(result, tuple) else result
    old = match.replaces
    if new.type.dtype != old.type.dtype or tuple(new.type.shape) != tuple(old.type.shape):
        raise GraphError(f"{match.op} would give {new.type} where the subgraph gives {old.type}")
    keep_name = any(o is old for o in graph.outputs)
    old.replace_all_uses_with(new, graph)
    live = live_nodes(graph)
    for node in [n for n in graph.topological_order() if n not in live][::-1]:
        graph.remove(node)
    drop_unused_constants(graph)                   # the matched nodes' own constants (slice bounds, axes)
    if keep_name:
        new.name = old.name
    return builder


def apply_patterns(graph: Graph, extend: Callable[[Graph], GraphBuilder]) -> FusionReport:
    """Fuse ``graph`` in place (the caller passes a copy) with ``extend = GraphBuilder.extend``; the graph is
    rebuilt (verified, typed) before it returns."""
    report = FusionReport(graph.name)
    seen_misses: set[tuple[str, str, str]] = set()
    count = 0
    changed = True
    while changed:
        changed = False
        for pattern in patterns():
            for node in graph.topological_order():
                if node.graph is not graph or node.op_type != pattern.anchor or node.domain != "":
                    continue
                try:
                    result = pattern.match(GraphView(graph), node)
                except Exception as exc:   # a graph the matcher did not foresee: reported, never a crash
                    result = NearMiss(f"the matcher failed on this node ({type(exc).__name__}: {exc})")
                if isinstance(result, Match):
                    count += 1
                    name = f"fused_{result.op}_{count}"
                    replaced = tuple(n.name for n in result.nodes)
                    try:
                        builder = _apply(graph, result, extend, name)
                    except GraphError as exc:
                        result = NearMiss(f"{result.op} refused it: {str(exc).splitlines()[0]}")
                        _undo(graph, name)
                    else:
                        graph = builder.build()
                        report.fused.append(Fused(pattern.name, replaced, f"{result.op} '{name}'"))
                        changed = True
                        break
                if isinstance(result, NearMiss):
                    key = (pattern.name, node.name, result.reason)
                    if key not in seen_misses:
                        seen_misses.add(key)
                        report.near_misses.append(Missed(pattern.name, node.name, result.reason))
            if changed:
                break
    graph.invalidate()
    return report


def _undo(graph: Graph, name: str) -> None:
    """Remove what a refused match added (its casts, reshapes, constants and, if it was created, its node), so the
    graph is as before."""
    for node in [n for n in graph.topological_order() if n.name == name or n.name.startswith(f"{name}_")][::-1]:
        if not any(v is not None and v.uses for v in node.outputs):
            graph.remove(node)
    drop_unused_constants(graph, f"{name}_")
