"""InferShapes: shape/dtype inference and the semantic rules of every node, in dependency order."""

from __future__ import annotations

from ..ir._core import Graph, Node
from ..ir._errors import GraphError
from ..ir._types import SymbolTable, TensorType, refine_all
from ..schemas import InferContext

from ._infra import Pass, PassResult

__all__ = ["InferShapes", "infer_node"]


def infer_node(node: Node, symbols: SymbolTable, input_types=None,
               constants: dict | None = None) -> tuple[InferContext, tuple[TensorType | None, ...]]:
    """Run one node's semantic rules and inference on its (or the given) input types."""
    types = [v.type if v is not None else None for v in node.inputs] if input_types is None else input_types
    ctx = InferContext(node.schema, node.name, types, node.attributes, symbols=symbols, location=node.location,
                       input_values=[constants.get(v.name) if v is not None and v.producer is None else None
                                     for v in node.inputs] if constants else None, declared=node.declared)
    return ctx, refine_all(node.schema.infer_types(ctx), node.declared)


class InferShapes(Pass):
    """Recomputes every output type from its inputs; rejects a node whose semantic rules fail.

    A stored output type that disagrees with the inferred one is replaced (imported graphs);
    an output slot that inference says must be absent but holds a value is an error. A node whose
    input types and attributes are those its rules last ran on (``Node.inferred``) is not re-run.
    """

    requires = frozenset({"verified"})
    ensures = frozenset({"typed"})
    preserves = frozenset({"verified"})   # only output types change

    def call(self, graph: Graph) -> PassResult:
        modified = False
        for node in graph.topological_order():
            key = node.inference_key()
            if node.inferred is not None and node.inferred[0] == key:
                types = node.inferred[1]          # the rules already ran on exactly these inputs
            else:
                _, types = infer_node(node, graph.symbols, constants=graph.constants)
                node.inferred = (key, tuple(types))
            for i, (value, inferred) in enumerate(zip(node.outputs, types)):
                if value is None:
                    continue
                if inferred is None:
                    raise GraphError(
                        f"{node.op_type} '{node.name}': output {i} '{node.schema.outputs[i].name}': expected "
                        f"no value (its paired input is absent), got '{value.name}'",
                        node=node.name, location=node.location)
                if value.type != inferred:
                    value.type = inferred
                    modified = True
        return PassResult(graph, modified)
