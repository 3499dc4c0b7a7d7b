"""VerifyGraph: structural and schema conformance of a graph (no shape reasoning)."""

from __future__ import annotations

from ..ir._core import Graph
from ..ir._errors import GraphError
from ..schemas import get_schema

from ._infra import Pass, PassResult

__all__ = ["FillDefaults", "VerifyGraph"]


class FillDefaults(Pass):
    """Normalises every node's attributes through its schema: defaults filled in, lists as tuples,
    unknown or ill-kinded attributes rejected (SCH-1, SCH-3, SCH-4)."""

    preserves = frozenset({"verified", "typed"})

    def call(self, graph: Graph) -> PassResult:
        modified = False
        for node in graph.nodes:
            schema = get_schema(node.op_type, node.domain, node.name, outputs=len(node.outputs), version=node.version)
            bound = schema.bind_attributes(node.attributes, node.name, node.location)
            if bound != node.attributes:
                node.attributes = bound
                modified = True
        return PassResult(graph, modified)


class VerifyGraph(Pass):
    """Checks, in order:

    - every value has a unique name and is produced once (as a graph input or by one node);
    - every node input is a value of this graph; graph outputs exist and are named uniquely;
    - the node graph has no cycle (networkx);
    - each node's op is known (SCH-1), its attributes are declared and of the right kind
      with required ones present (SCH-3, SCH-4), its arity and input dtypes are legal
      (SCH-2, SCH-5, SCH-6), and it has one output slot per declared output.

    It changes nothing: defaults are filled by ``FillDefaults``, which runs before it.
    """

    ensures = frozenset({"verified"})

    def call(self, graph: Graph) -> PassResult:
        producers: dict[str, object] = {}
        known = set()
        for value in graph.values():
            if value.name in producers:
                raise GraphError(f"graph '{graph.name}': value name '{value.name}' is defined twice")
            producers[value.name] = value.producer
            known.add(id(value))
        names = set()
        for node in graph.nodes:
            if node.name in names:
                raise GraphError(f"graph '{graph.name}': node name '{node.name}' is used twice", node=node.name)
            names.add(node.name)
            for i, value in enumerate(node.inputs):
                if value is not None and id(value) not in known:
                    raise GraphError(
                        f"{node.op_type} '{node.name}': input {i} '{value.name}' is not a value of graph "
                        f"'{graph.name}'", node=node.name, location=node.location)
        out_names = [v.name for v in graph.outputs]
        if len(set(out_names)) != len(out_names):
            raise GraphError(f"graph '{graph.name}': output names {out_names} are not unique")
        for value in graph.outputs:
            if id(value) not in known:
                raise GraphError(f"graph '{graph.name}': output '{value.name}' is not produced in the graph")
        graph.topological_order()  # raises on a cycle
        for node in graph.nodes:
            schema = get_schema(node.op_type, node.domain, node.name, outputs=len(node.outputs), version=node.version)
            schema.bind_attributes(node.attributes, node.name, node.location)   # validates; FillDefaults stores
            if len(node.outputs) != len(schema.outputs):
                raise GraphError(
                    f"[SCH-2] {node.op_type} '{node.name}': outputs: expected {len(schema.outputs)} output "
                    f"slots, got {len(node.outputs)}", rule="SCH-2", node=node.name, location=node.location)
            schema.check_signature([v.type if v is not None else None for v in node.inputs], node.name,
                                   node.location)
        return PassResult(graph, False)
