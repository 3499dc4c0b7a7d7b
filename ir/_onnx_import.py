"""Import an ONNX model as a geir Graph: our ``ai.cann`` nodes map back to their schemas, standard
ONNX nodes stay standard nodes, our generated FunctionProtos are dropped and other local
functions are inlined. Every node goes through the builder, so a bad file fails like a bad
graph: a GraphError naming the node.
"""

from __future__ import annotations

import os

import networkx as nx
from onnx import ModelProto, inliner, load_model, numpy_helper

from ._builder import GraphBuilder
from ._core import CANN_DOMAIN, Graph, Value
from ._errors import GraphError
from ._onnx_schemas import register_onnx_schemas
from ._onnx_types import attribute_from_onnx, tensor_type_from_onnx

__all__ = ["from_onnx", "load_onnx"]


def load_onnx(path: str | os.PathLike) -> Graph:
    """Read an ONNX file and import it (``from_onnx``)."""
    return from_onnx(load_model(os.fspath(path)))


def from_onnx(model: ModelProto) -> Graph:
    """A built (verified, typed) geir Graph from an ONNX model."""
    from geir.schemas import all_schemas

    register_onnx_schemas()
    ours = {s.op_type for s in all_schemas()}
    foreign = [(f.domain, f.name) for f in model.functions if not (f.domain == CANN_DOMAIN and f.name in ours)]
    if foreign:
        model = inliner.inline_selected_functions(model, foreign, exclude=False)
    graph = model.graph
    b = GraphBuilder(graph.name or "imported")
    values: dict[str, Value] = {}
    for init in graph.initializer:
        values[init.name] = b.constant(init.name, numpy_helper.to_array(init))
    for vi in graph.input:
        if vi.name not in values:
            t = tensor_type_from_onnx(vi.type, f"graph input '{vi.name}'")
            values[vi.name] = b.input(vi.name, t.dtype, t.shape)
    for node in _dependency_order(graph, set(values)):
        _import_node(b, node, values)
    for vi in graph.output:
        if vi.name not in values:
            raise GraphError(f"graph output '{vi.name}' is produced by no node and is no input")
        b.output(values[vi.name])
    return b.build()


def _dependency_order(graph, available: set[str]) -> list:
    """Nodes in dependency order (networkx); GraphError on a cycle or an undefined input."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.node)))
    for i, node in enumerate(graph.node):
        for name in node.input:
            if not name or name in available:
                continue
            if name not in producer:
                raise GraphError(f"{node.op_type} '{node.name}': input '{name}' is no graph input, initializer or "
                                 f"node output", node=node.name)
            dag.add_edge(producer[name], i)
    try:
        cycle = nx.find_cycle(dag)
    except nx.NetworkXNoCycle:
        return [graph.node[i] for i in nx.lexicographical_topological_sort(dag)]
    names = " -> ".join(f"'{graph.node[u].name or graph.node[u].op_type}'" for u, _ in cycle)
    raise GraphError(f"graph '{graph.name}' has a cycle: {names} -> '{graph.node[cycle[0][0]].name}'")


def _import_node(b: GraphBuilder, node, values: dict[str, Value]) -> None:
    from geir.schemas import get_schema

    domain = node.domain or ""
    name = node.name or None
    if domain == CANN_DOMAIN:
        schema = get_schema(node.op_type, domain, node.name)
        kinds = {a.name: a.kind.value for a in schema.attributes}
        attrs = {a.name: attribute_from_onnx(a, kinds.get(a.name)) for a in node.attribute}
    elif domain in ("", "ai.onnx"):
        schema = get_schema(node.op_type, "", node.name)
        attrs = {a.name: attribute_from_onnx(a, None) for a in node.attribute}
    else:
        raise GraphError(f"{node.op_type} '{node.name}': domain '{domain}' is neither ours ({CANN_DOMAIN}) nor "
                         f"standard ONNX", node=node.name)
    inputs = [values[n] if n else None for n in node.input]
    results = b._add(schema, inputs, {}, attrs, name, output_names=list(node.output))
    for value in results if isinstance(results, tuple) else (results,):
        if value is not None:
            values[value.name] = value

