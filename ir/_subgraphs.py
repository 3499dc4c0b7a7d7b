"""Outer-scope reads of subgraphs (If branches, Loop and Scan bodies).

ONNX lets a subgraph read any value of its enclosing graphs by name. geir makes each such read an ordinary input
of the node holding the subgraph: after the op's own inputs come its *captures*, one per name in
``captured_names(attributes)`` (sorted), so uses, dead-code elimination, ordering, renames and the executable's
liveness follow them like any other input. Whoever hands the node to ONNX (export, the NumPy kernel, shape
inference) drops the captures from the input list and renames the subgraphs' free names to the names the
captured values have there (``rename_captures``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onnx import AttributeProto, GraphProto

__all__ = ["captured_names", "rename_captures", "rename_in_node", "subgraphs_of"]


def _defined(graph: GraphProto) -> set[str]:
    return ({v.name for v in graph.input} | {t.name for t in graph.initializer} |
            {t.values.name for t in graph.sparse_initializer} | {o for n in graph.node for o in n.output if o})


def subgraphs_of(value: Any) -> list[GraphProto]:
    """The graphs an attribute (an AttributeProto, or its Python value) holds: its g and graphs."""
    if isinstance(value, GraphProto):
        return [value]
    if isinstance(value, AttributeProto):
        return ([value.g] if value.HasField("g") else []) + list(value.graphs)
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, GraphProto)]
    return []


def _free(graph: GraphProto) -> set[str]:
    defined = _defined(graph)
    read = {name for node in graph.node for name in node.input if name} | {v.name for v in graph.output}
    for node in graph.node:
        for attribute in node.attribute:
            for sub in subgraphs_of(attribute):
                read |= _free(sub)
    return read - defined


def captured_names(attributes: Mapping[str, Any]) -> tuple[str, ...]:
    """The names the node's subgraph attributes read from enclosing scopes, sorted (empty for a node with none)."""
    free: set[str] = set()
    for value in attributes.values():
        for graph in subgraphs_of(value):
            free |= _free(graph)
    return tuple(sorted(free))


def _rename(graph: GraphProto, mapping: Mapping[str, str]) -> GraphProto:
    mapping = {k: v for k, v in mapping.items() if k not in _defined(graph)}   # a local definition shadows
    if not mapping:
        return graph
    out = GraphProto()
    out.CopyFrom(graph)
    for node in out.node:
        node.input[:] = [mapping.get(name, name) for name in node.input]
        for attribute in node.attribute:
            if attribute.HasField("g"):
                attribute.g.CopyFrom(_rename(attribute.g, mapping))
            for i, sub in enumerate(attribute.graphs):
                attribute.graphs[i].CopyFrom(_rename(sub, mapping))
    for value in out.output:
        value.name = mapping.get(value.name, value.name)
    return out


def rename_captures(attributes: Mapping[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    """``attributes`` with every subgraph's free name ``old`` read as ``mapping[old]`` (copies; the given are kept)."""
    mapping = {k: v for k, v in mapping.items() if k != v}
    if not mapping:
        return dict(attributes)
    renamed: dict[str, Any] = {}
    for key, value in attributes.items():
        if isinstance(value, GraphProto):
            renamed[key] = _rename(value, mapping)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, GraphProto) for v in value):
            renamed[key] = type(value)(_rename(v, mapping) for v in value)
        else:
            renamed[key] = value
    return renamed


def rename_in_node(proto, mapping: Mapping[str, str]) -> None:
    """Rename the free names of a NodeProto's subgraphs in place (``rename_captures`` for a node already written)."""
    mapping = {k: v for k, v in mapping.items() if k != v}
    if not mapping:
        return
    for attribute in proto.attribute:
        if attribute.HasField("g"):
            attribute.g.CopyFrom(_rename(attribute.g, mapping))
        for i, sub in enumerate(attribute.graphs):
            attribute.graphs[i].CopyFrom(_rename(sub, mapping))
