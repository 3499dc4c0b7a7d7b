"""The SSA graph: values that know their producer and uses, nodes, and the graph itself."""

from __future__ import annotations

import copy
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

import networkx as nx
import numpy as np

from ._dot import graph_to_dot, render
from ._errors import GraphError, SourceLocation
from ._registry import get_schema
from ._schema import Schema
from ._types import SymbolTable, TensorType

__all__ = ["Graph", "Node", "Value", "unused_name"]


def unused_name(stem: str, taken: Container[str]) -> str:
    """``stem``, else the first of ``stem_1``, ``stem_2``, ... that ``taken`` does not hold."""
    name, n = stem, 1
    while name in taken:
        name, n = f"{stem}_{n}", n + 1
    return name

CANN_DOMAIN = "ai.cann"


class Value:
    """An SSA value: produced once (by a node, or as a graph input), used by any number of nodes."""

    __slots__ = ("name", "type", "producer", "index", "_uses")

    def __init__(self, name: str, type: TensorType, producer: Node | None = None, index: int = 0) -> None:
        self.name = name
        self.type = type
        self.producer = producer
        self.index = index
        self._uses: list[tuple[Node, int]] = []

    def __copy__(self) -> Value:
        """Refused: a shallow copy would share this value's use list, so editing one corrupts the other."""
        raise GraphError(f"value '{self.name}' cannot be copied on its own (its uses and producer belong to its "
                         "graph); copy the graph instead (copy.copy(graph), GraphBuilder.copy)")

    @property
    def uses(self) -> tuple[tuple[Node, int], ...]:
        """``(node, input_index)`` for every input slot that reads this value."""
        return tuple(self._uses)

    def replace_all_uses_with(self, other: Value, graph: Graph | None = None) -> None:
        """Make every node input that reads this value read ``other`` instead (and, with ``graph``, its
        outputs: ``other`` takes this value's place and name among them)."""
        if other is self:
            return
        for node, index in list(self._uses):
            node.set_input(index, other)
        if graph is not None:
            for i, out in enumerate(graph.outputs):
                if out is self:
                    graph.outputs[i] = other
            graph.invalidate()

    @property
    def dtype(self):
        return self.type.dtype

    @property
    def shape(self):
        return self.type.shape

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.type})"


class Node:
    """One operator application. Inputs are an immutable tuple (None for absent optional inputs)."""

    __slots__ = ("op_type", "domain", "name", "_inputs", "attributes", "outputs", "location", "inferred", "graph",
                 "version", "declared")

    def __init__(
        self,
        op_type: str,
        inputs: Sequence[Value | None],
        attributes: Mapping[str, Any],
        output_types: Sequence[tuple[str, TensorType] | None],
        *,
        name: str,
        domain: str = CANN_DOMAIN,
        location: SourceLocation | None = None,
        version: int | None = None,
    ) -> None:
        self.op_type = op_type
        self.domain = domain
        self.version = version
        self.declared: tuple[TensorType | None, ...] | None = None
        """Output types an imported file declares (its value_info and ONNX's shape inference of the whole file):
        inference fills its gaps from them (``ir._types.refine``)."""
        """A standard node's opset: the version of ONNX's definition it follows (an imported node keeps its
        model's; None is geir's default opset). Our ops have one version and ignore it."""
        self.name = name
        self.attributes = dict(attributes)
        self.location = location
        self.inferred: tuple[Any, tuple] | None = None
        """(inference key, output types) of the last time this node's rules ran; see ``inference_key``."""
        self.graph: Graph | None = None
        """The graph holding this node (set by ``Graph.append``/``insert_*``, cleared by ``remove``)."""
        self._inputs: tuple[Value | None, ...] = ()
        for i, value in enumerate(inputs):
            self._inputs += (value,)
            if value is not None:
                value._uses.append((self, i))
        self.outputs: tuple[Value | None, ...] = tuple(
            None if spec is None else Value(spec[0], spec[1], self, i) for i, spec in enumerate(output_types)
        )

    @property
    def inputs(self) -> tuple[Value | None, ...]:
        return self._inputs

    def __copy__(self) -> Node:
        """Refused: a shallow copy would share this node's output values and appear in no use list."""
        raise GraphError(f"{self.op_type} '{self.name}' cannot be copied on its own (its values belong to its graph); "
                         "copy the graph instead (copy.copy(graph), GraphBuilder.copy)", node=self.name)

    def set_input(self, index: int, value: Value | None) -> None:
        """Replace input ``index``, keeping both values' use lists right; the graph holding this node
        forgets its passes' guarantees (it must be built or verified again before it runs)."""
        old = self._inputs[index]
        if old is not None:
            old._uses.remove((self, index))
        if value is not None:
            value._uses.append((self, index))
        self._inputs = self._inputs[:index] + (value,) + self._inputs[index + 1 :]
        self.inferred = None
        if self.graph is not None:
            self.graph.invalidate()

    def inference_key(self, input_types: Sequence[TensorType | None] | None = None) -> tuple:
        """What a node's rules and inference depend on: its input types and attributes (constant
        inputs are fixed for a node's life: replacing an input clears the cached result)."""
        types = tuple(v.type if v is not None else None for v in self._inputs) if input_types is None else \
            tuple(input_types)
        return types, tuple(sorted((k, repr(v)) for k, v in self.attributes.items()))

    @property
    def schema(self) -> Schema:
        """The op's declaration, from the one registry (a standard op's with this node's output count)."""
        return get_schema(self.op_type, self.domain, self.name, outputs=len(self.outputs), version=self.version)

    def __str__(self) -> str:
        outs = ", ".join(v.name if v is not None else "_" for v in self.outputs)
        ins = ", ".join(v.name if v is not None else "None" for v in self._inputs)
        attrs = ", ".join(f"{k}={_format_attr(v)}" for k, v in self.attributes.items())
        op = f"{self.domain}::{self.op_type}" if self.domain else self.op_type
        text = f"{outs} = {op}({ins})"
        if attrs:
            text += f" {{{attrs}}}"
        return text + f"  # '{self.name}'" + (f" at {self.location}" if self.location else "")

    def __repr__(self) -> str:
        return f"Node({self.op_type!r}, name={self.name!r})"


def _format_attr(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(str(v) for v in value) + "]"
    return repr(value)


class Graph:
    """A named SSA graph: ordered inputs, nodes (in insertion order) and named outputs.

    ``symbols`` holds the symbolic dimensions declared equal; ``properties`` records what
    passes have guaranteed (``"verified"``, ``"typed"``, ...).
    """

    def __init__(self, name: str, symbols: SymbolTable | None = None) -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.constants: dict[str, np.ndarray] = {}
        """Initializers: named arrays (their Values are in ``constant_values``), never fed."""
        self.defaults: dict[str, np.ndarray] = {}
        """Overridable defaults of inputs (ONNX: an input with a same-name initializer), by input name: the
        array used when that input is not fed. Set with ``set_default``."""
        self.constant_values: list[Value] = []
        self.nodes: list[Node] = []
        self.symbols = symbols if symbols is not None else SymbolTable()
        self.properties: set[str] = set()
        self.revision = 0
        """Counts the edits (every ``invalidate``): an executable compiled at another revision refuses to run."""
        self.compiled: dict[object, object] = {}
        """What runtimes derived from this revision (executables, the feed checks' input table), by their key; cleared
        by ``invalidate``. Compiling the same graph again is free, and kept here rather than in a global table, an
        executable lives and dies with its graph."""

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles carry the graph, not the executables compiled from it (a session cannot be copied)."""
        return {**self.__dict__, "compiled": {}}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update({"defaults": {}, **state})   # a graph pickled before inputs had defaults has none
        for array in self.defaults.values():              # copied arrays come back writeable: the graph's own again
            array.flags.writeable = False

    def __copy__(self) -> Graph:
        """An independent copy, as ``copy.deepcopy``: a shallow copy would share the node, input and output lists
        and the values' use lists, so an edit of one graph would change the other behind its back."""
        return copy.deepcopy(self)

    def set_default(self, name: str, array: np.ndarray | None) -> None:
        """Give input ``name`` an overridable default (used when it is not fed), or remove it with None.

        GraphError when ``name`` is no input, or the array's dtype or a static dim differs from the input's type.
        """
        value = next((v for v in self.inputs if v.name == name), None)
        if value is None:
            raise GraphError(f"graph '{self.name}': default for {name!r}: no graph input has that name")
        if array is None:
            self.defaults.pop(name, None)
            self.invalidate()
            return
        array = np.array(array, copy=True)
        where = f"graph '{self.name}': default of input '{name}'"
        if array.dtype != value.dtype.numpy:
            raise GraphError(f"{where}: expected dtype {value.dtype}, got {array.dtype}")
        bound: dict[str, int] = {}
        if array.ndim != value.type.rank or any(
                d != n if isinstance(d, int) else bound.setdefault(self.symbols.canonical(d), n) != n
                for d, n in zip(value.shape, array.shape)):
            raise GraphError(f"{where}: expected shape {list(value.shape)}, got {list(array.shape)}")
        array.flags.writeable = False      # the graph's own, like a constant: no run writes into it
        self.defaults[name] = array
        self.invalidate()

    # -- editing (onnx-ir style): every change clears what passes had guaranteed ---------------------
    # (Node.set_input on a node of this graph does so too; editing attributes in place needs invalidate().)
    def invalidate(self) -> None:
        """Forget the passes' guarantees (``verified``, ``typed``) and the executables compiled from it: the graph
        changed since they were made."""
        self.properties.clear()
        self.compiled.clear()
        self.revision += 1

    def append(self, node: Node) -> Node:
        """Add ``node`` at the end of the node list."""
        self._check_new(node)
        self.nodes.append(node)
        node.graph = self
        self.invalidate()
        return node

    def insert_before(self, anchor: Node, node: Node) -> Node:
        """Add ``node`` just before ``anchor`` in the node list."""
        self._check_new(node)
        self.nodes.insert(self._position(anchor), node)
        node.graph = self
        self.invalidate()
        return node

    def insert_after(self, anchor: Node, node: Node) -> Node:
        """Add ``node`` just after ``anchor`` in the node list."""
        self._check_new(node)
        self.nodes.insert(self._position(anchor) + 1, node)
        node.graph = self
        self.invalidate()
        return node

    def remove(self, node: Node) -> None:
        """Take ``node`` out of the graph; GraphError while one of its outputs is still used."""
        position = self._position(node)
        outputs = {id(v) for v in self.outputs}
        for value in node.outputs:
            if value is not None and (value.uses or id(value) in outputs):
                users = [f"'{n.name}'" for n, _ in value.uses] + (["the graph outputs"] if id(value) in outputs else [])
                raise GraphError(f"graph '{self.name}': cannot remove {node.op_type} '{node.name}': its output "
                                 f"'{value.name}' is used by {', '.join(users)}", node=node.name)
        for i in range(len(node.inputs)):
            node.set_input(i, None)
        del self.nodes[position]
        node.graph = None
        self.invalidate()

    def _position(self, node: Node) -> int:
        for i, n in enumerate(self.nodes):
            if n is node:
                return i
        raise GraphError(f"graph '{self.name}': node '{node.name}' is not in this graph", node=node.name)

    def _check_new(self, node: Node) -> None:
        if node.graph is self or any(n is node for n in self.nodes):
            raise GraphError(f"graph '{self.name}': node '{node.name}' is already in this graph", node=node.name)
        if node.graph is not None:
            raise GraphError(f"graph '{self.name}': node '{node.name}' belongs to graph '{node.graph.name}'; "
                             "remove it there first", node=node.name)

    def values(self) -> Iterator[Value]:
        """Every value of the graph: inputs, constants, then node outputs in node order."""
        yield from self.inputs
        yield from self.constant_values
        for node in self.nodes:
            yield from (v for v in node.outputs if v is not None)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"graph '{self.name}' has no node named {name!r}")

    def to_networkx(self) -> nx.DiGraph:
        """The node dependency graph: an edge ``producer -> consumer`` per data dependency."""
        dag = nx.DiGraph()
        dag.add_nodes_from(self.nodes)
        for node in self.nodes:
            for value in node.inputs:
                if value is not None and value.producer is not None:
                    dag.add_edge(value.producer, node)
        return dag

    def topological_order(self) -> list[Node]:
        """Nodes in dependency order, ties broken by insertion order; GraphError on a cycle."""
        dag = self.to_networkx()
        try:
            cycle = nx.find_cycle(dag)
        except nx.NetworkXNoCycle:
            position = {n: i for i, n in enumerate(self.nodes)}
            return list(nx.lexicographical_topological_sort(dag, key=position.__getitem__))
        names = " -> ".join(f"'{u.name}'" for u, _ in cycle) + f" -> '{cycle[0][0].name}'"
        raise GraphError(f"graph '{self.name}' has a cycle: {names}")

    def to_dot(self) -> str:
        """The graph as Graphviz DOT text (``geir show --format dot``): typed edges, one box per node."""
        return graph_to_dot(self)

    def _repr_svg_(self) -> str | None:
        """The picture in a notebook when Graphviz is installed (None: the notebook shows the text)."""
        try:
            return render(self, "svg").decode()
        except GraphError:
            return None

    def __str__(self) -> str:
        lines = [f"graph {self.name}(" + ", ".join(f"{v.name}: {v.type}" for v in self.inputs) + ") {"]
        lines += [f"  {v.name} = constant {v.type}" for v in self.constant_values]
        lines += [f"  {name} defaults to {a.dtype}{list(a.shape)} when not fed" for name, a in self.defaults.items()]
        for node in self.nodes:
            lines.append("  " + str(node))
        lines.append("  return " + ", ".join(f"{v.name}: {v.type}" for v in self.outputs))
        lines.append("}")
        if self.symbols.groups():
            lines.append("symbols declared equal: " + "; ".join(" == ".join(sorted(g)) for g in self.symbols.groups()))
        return "\n".join(lines)
