"""Checks both runtimes run before a node computes: its semantic rules on the fed (concrete) shapes
and its run-time data rules. Written once, so every runtime raises the same ExecutionError text; data rules read
host NumPy views that the runtime's array backend makes (``runtimes._arrays``), for the nodes that have one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..ir._core import Graph, Node, Value
from ..ir._errors import ExecutionError, GraphError
from ..ir._types import TensorType
from ..passes import infer_node
from ..schemas import DataContext

from ._arrays import Array, ArrayBackend, HostArray

__all__ = ["concrete_types", "describe", "is_symbolic", "output_types_on", "validate_node_data"]


def describe(node: Node) -> str:
    """``Op 'name' (built at file:line)``, as every runtime error names a node."""
    return f"{node.op_type} '{node.name}'" + (f" (built at {node.location})" if node.location else "")


def is_symbolic(node: Node) -> bool:
    """Whether some input type holds a symbol, so rules may have been deferred at build time."""
    return not all(v.type.is_static for v in node.inputs if v is not None)


MAX_REMEMBERED_SHAPES = 4096
"""How many (node, fed input shapes) results a graph revision keeps (``output_types_on``)."""


def output_types_on(graph: Graph, node: Node, shapes: Sequence[tuple[int, ...] | None]) -> list[TensorType | None]:
    """Re-run ``node``'s semantic rules and inference on concrete input shapes; its output types.

    What passed is remembered per graph revision and input shapes (the rules and inference read only the shapes, the
    attributes and the graph's constants, all fixed for a revision), so a run on shapes seen before costs a lookup,
    not ONNX's shape inference again; a failure is never remembered and raises on every run.

    Raises ExecutionError (rule id, node, operand and dim, as the build-time GraphError said them).
    """
    remembered: dict[tuple[str, tuple[tuple[int, ...] | None, ...]], tuple[TensorType | None, ...]] = \
        graph.compiled.setdefault(("checks", "types on fed shapes"), {})  # type: ignore[assignment]
    key = (node.name, tuple(shapes))
    found = remembered.get(key)
    if found is not None:
        return list(found)
    concrete = [None if s is None else TensorType(v.type.dtype, s) for v, s in zip(node.inputs, shapes)]
    try:
        _, types = infer_node(node, graph.symbols, concrete, graph.constants)
    except GraphError as exc:
        raise ExecutionError(f"{exc.message} (on the fed shapes; {describe(node)})", node=node.name,
                             rule=exc.rule) from None
    for value, t in zip(node.outputs, types):
        if value is not None and t is not None and t.has_rank:
            _check_declared(node, value, t)
    if len(remembered) < MAX_REMEMBERED_SHAPES:
        remembered[key] = tuple(types)
    return list(types)


def concrete_types(graph: Graph, order: Sequence[Node], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorType]:
    """Concrete types of every value whose shape follows from the fed shapes, checking each symbolic node.

    Nodes whose inputs are all known are re-checked on them (``output_types_on``); a value whose
    shape depends on data (a computed Reshape target, say) stays unknown, and so does what it feeds. The result is
    remembered per graph revision, node order and fed shapes, as ``output_types_on``'s are.
    """
    remembered: dict[tuple[int, tuple[tuple[str, tuple[int, ...]], ...]], dict[str, TensorType]] = \
        graph.compiled.setdefault(("checks", "concrete types"), {})  # type: ignore[assignment]
    key = (len(order), tuple(sorted(shapes.items())))
    found = remembered.get(key)
    if found is not None:
        return dict(found)
    known: dict[str, TensorType] = {v.name: TensorType(v.type.dtype, shapes[v.name]) for v in graph.inputs
                                    if v.name in shapes}
    known.update({c.name: c.type for c in graph.constant_values})
    for node in order:
        inputs = [None if v is None else known.get(v.name, v.type if v.type.is_static else None) for v in node.inputs]
        unknown = any(v is not None and t is None for v, t in zip(node.inputs, inputs))
        if unknown or not is_symbolic(node):
            types = [None if v is None else v.type for v in node.outputs]
        else:
            types = output_types_on(graph, node, [None if t is None else t.shape for t in inputs])
        for value, t in zip(node.outputs, types):
            if value is not None and t is not None and t.is_static:
                known[value.name] = t
    if len(remembered) < MAX_REMEMBERED_SHAPES:
        remembered[key] = dict(known)
    return known


def _check_declared(node: Node, value: Value, concrete: TensorType) -> None:
    """A size the graph states for ``value`` (a file's claim, ``ir._types.refine``) holds on the fed shapes."""
    stated = value.type.dims
    if stated is not None and (len(stated) != len(concrete.shape) or any(
            isinstance(d, int) and isinstance(c, int) and d != c for d, c in zip(stated, concrete.shape))):
        raise ExecutionError(f"{describe(node)}: output '{value.name}': the graph states {value.type}, the fed shapes "
                             f"make it {concrete}", node=node.name)


def validate_node_data(node: Node, arrays: Sequence[Array | None], attributes: Mapping[str, object] | None = None,
                       backend: ArrayBackend[Any] | None = None) -> None:
    """The node's run-time data rules (``..-D#``) on the arrays it reads (under ``attributes``, default the node's:
    an executable passes those it was compiled with); ExecutionError on bad data.

    The rules read NumPy arrays in host memory: ``backend.host_view`` of each input, made only when the node has a
    rule, with values only for the inputs whose values it reads (``validated_inputs``; of the others it reads the
    shape); without a backend ``arrays`` are NumPy arrays already."""
    if node.schema.validate is not None:
        host: Sequence[HostArray | None] = arrays
        if backend is not None:
            names, read = node.schema.input_names, node.schema.validated_inputs
            host = [None if a is None else backend.host_view(a, values=k >= len(names) or names[k] in read)
                    for k, a in enumerate(arrays)]
        node.schema.validate(DataContext(node.schema, node.name, host,
                                         node.attributes if attributes is None else attributes,
                                         location=node.location))
