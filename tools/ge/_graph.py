"""``ge.Graph``: ops added, inputs and outputs set as in GE, converted to a built ``geir.Graph``.

The conversion walks back from the outputs, declares one graph input per ``Data`` op (in ``index``
order), adds each op through ``GraphBuilder.add_node`` (so every rule and error applies, with the
line where the op was created), then checks every desc the user declared against what the graph
infers there.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..builder import GraphBuilder
from ...ir._core import Graph as GeirGraph
from ...ir._core import Value
from ...ir._errors import GraphError
from ...ir._types import TensorType
from . import op
from ._operator import Const, Data, Operator
from ._tensor import FORMAT_ND, SUCCESS, UNKNOWN_DIM, Shape, Tensor, TensorDesc, ge_data_type, geir_dtype

__all__ = ["Graph"]

OutputSpec = Operator | tuple[Operator, Sequence[int] | str | int]


class Graph:
    """``ge::Graph``."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"ge.Graph: name: expected a non-empty string, got {name!r}")
        self._name = name
        self._ops: list[Operator] = []
        self._inputs: list[Operator] = []
        self._outputs: list[tuple[Operator, list[int]]] = []

    def GetName(self) -> str:
        return self._name

    def AddOp(self, operator: Operator) -> int:
        if not isinstance(operator, Operator):
            raise GraphError(f"graph '{self._name}': AddOp: expected a ge operator, got {type(operator).__name__}")
        if any(o is not operator and o.GetName() == operator.GetName() for o in self._ops):
            raise GraphError(f"graph '{self._name}': AddOp: an op named '{operator.GetName()}' is already in the graph")
        if all(o is not operator for o in self._ops):
            self._ops.append(operator)
        return SUCCESS

    def SetInputs(self, inputs: Sequence[Operator]) -> Graph:
        for i, item in enumerate(inputs):
            if not isinstance(item, Data):
                raise GraphError(f"graph '{self._name}': SetInputs: item {i}: expected a ge.op.Data, got {item!r}")
        self._inputs = list(inputs)
        return self

    def SetOutputs(self, outputs: Sequence[OutputSpec]) -> Graph:
        """Ops (all their outputs) or ``(op, [indices])`` / ``(op, "output name")`` pairs, in order."""
        chosen: list[tuple[Operator, list[int]]] = []
        for i, item in enumerate(outputs):
            source, which = (item, None) if isinstance(item, Operator) else (tuple(item) + (None,))[:2]
            if not isinstance(source, Operator):
                raise GraphError(f"graph '{self._name}': SetOutputs: item {i}: expected an op or (op, indices), "
                                 f"got {item!r}")
            subject = f"graph '{self._name}': SetOutputs item {i}"
            if which is None:
                indices = list(range(len(source.output_names)))
            elif isinstance(which, (str, int)):
                indices = [source.output_index(which, subject)]
            else:
                indices = [source.output_index(k, subject) for k in which]
            chosen.append((source, indices))
        self._outputs = chosen
        return self

    # -- conversion ---------------------------------------------------------------------------
    def to_geir(self) -> GeirGraph:
        """The built geir graph (GraphError naming the op and the input or desc that is wrong)."""
        if not self._outputs:
            raise GraphError(f"graph '{self._name}': no outputs; call SetOutputs([...]) first")
        order = self._topological_order()
        data_ops = self._ordered_inputs(order)
        b = GraphBuilder(self._name)
        values: dict[int, list[Value | None]] = {}
        for data in data_ops:
            desc = data.desc()
            dtype = geir_dtype(desc.GetDataType(), f"Data '{data.GetName()}'")
            dims = [f"{data.GetName()}_dim{k}" if d == UNKNOWN_DIM else d for k, d in enumerate(desc.GetShape().GetDims())]
            values[id(data)] = [b.input(data.GetName(), dtype, dims)]
        for node in order:
            if isinstance(node, Data):
                continue
            if isinstance(node, Const):
                tensor = node.get_attr_value()
                if tensor is None:
                    raise GraphError(f"Const '{node.GetName()}': attribute 'value' has not been set", node=node.GetName())
                values[id(node)] = [b.constant(node.GetName(), tensor.GetData())]
                continue
            schema = node.schema
            inputs: list[Value | None] = []
            for i in range(len(node.input_names)):
                link = node.inputs.get(i)
                inputs.append(None if link is None else values[id(link[0])][link[1]])
            names = [f"{node.GetName()}.{n}" for n in node.output_names]
            result = b.add_node(schema, inputs, dict(node.attributes), name=node.GetName(), output_names=names,
                                location=node.location)
            values[id(node)] = list(result) if isinstance(result, tuple) else [result]
            _check_descs(node, inputs, values[id(node)])
        for source, indices in self._outputs:
            for k in indices:
                value = values[id(source)][k]
                if value is None:
                    raise GraphError(f"graph '{self._name}': output {k} '{source.output_names[k]}' of "
                                     f"{source.GetOpType()} '{source.GetName()}' is absent (an optional output)")
                b.output(value)
        return b.build()

    def _topological_order(self) -> list[Operator]:
        order: list[Operator] = []
        state: dict[int, str] = {}

        def visit(node: Operator, path: list[str]) -> None:
            if state.get(id(node)) == "done":
                return
            if state.get(id(node)) == "open":
                cycle = " -> ".join(path[path.index(node.GetName()):] + [node.GetName()])
                raise GraphError(f"graph '{self._name}' has a cycle: {cycle}")
            state[id(node)] = "open"
            for index in sorted(node.inputs):
                visit(node.inputs[index][0], path + [node.GetName()])
            state[id(node)] = "done"
            order.append(node)

        for source, _ in self._outputs:
            visit(source, [])
        return order

    def _ordered_inputs(self, order: list[Operator]) -> list[Data]:
        """The Data ops by ``index``: every one reached is in SetInputs, indices 0..n-1 each once."""
        listed = {id(d) for d in self._inputs}
        for node in order:
            if isinstance(node, Data) and id(node) not in listed:
                raise GraphError(f"graph '{self._name}': Data '{node.GetName()}' feeds the outputs but is not in "
                                 "SetInputs([...])", node=node.GetName(), location=node.location)
        by_index: dict[int, Data] = {}
        count = len(self._inputs)
        for data in self._inputs:
            index = data.get_attr_index()
            subject = f"graph '{self._name}': Data '{data.GetName()}': attribute 'index'"
            if index is None:
                raise GraphError(f"{subject} has not been set (set_attr_index(i))", node=data.GetName())
            if index >= count:
                raise GraphError(f"{subject}: expected 0..{count - 1} (one per input of SetInputs), got {index}: "
                                 "indices skip a position", node=data.GetName())
            if index in by_index:
                raise GraphError(f"{subject}: expected each of 0..{count - 1} once, got {index} again (also "
                                 f"Data '{by_index[index].GetName()}')", node=data.GetName())
            by_index[index] = data
        return [by_index[i] for i in range(count)]

    @classmethod
    def from_geir(cls, graph: GeirGraph) -> Graph:
        """The ge graph of a geir graph: one Data op per input, one op per node, the same outputs."""
        ge_graph = cls(graph.name)
        made: dict[int, tuple[Operator, int]] = {}
        inputs = []
        for i, value in enumerate(graph.inputs):
            data = Data(value.name).set_attr_index(i).update_output_desc_y(desc_of(value.type))
            made[id(value)] = (data, 0)
            inputs.append(data)
            ge_graph.AddOp(data)
        for value in graph.constant_values:
            const = Const(value.name).set_attr_value(Tensor(desc_of(value.type), graph.constants[value.name]))
            made[id(value)] = (const, 0)
            ge_graph.AddOp(const)
        for node in graph.topological_order():
            operator = getattr(op, node.op_type)(node.name)
            operator.location = node.location
            for i, value in enumerate(node.inputs):
                if value is not None:
                    source, k = made[id(value)]
                    operator.SetInput(operator.input_names[i], source, k)
            for name, attr in node.attributes.items():
                operator.attributes[name] = attr
            for k, value in enumerate(node.outputs):
                if value is not None:
                    made[id(value)] = (operator, k)
            ge_graph.AddOp(operator)
        ge_graph.SetInputs(inputs)
        ge_graph.SetOutputs([(made[id(v)][0], [made[id(v)][1]]) for v in graph.outputs])
        return ge_graph


def desc_of(t: TensorType) -> TensorDesc:
    """A desc of a geir type (symbolic dims become -1)."""
    return TensorDesc(Shape([d if isinstance(d, int) else UNKNOWN_DIM for d in t.shape]), FORMAT_ND,
                      ge_data_type(t.dtype))


def _matches(desc: TensorDesc, t: TensorType) -> bool:
    dims = desc.GetShape().GetDims()
    return (desc.GetDataType() == ge_data_type(t.dtype) and len(dims) == len(t.shape)
            and all(d == UNKNOWN_DIM or d == s for d, s in zip(dims, t.shape)))


def _check_descs(node: Operator, inputs: list[Value | None], outputs: list[Value | None]) -> None:
    """Every declared desc must be what the graph has there."""
    for kind, descs, values, names in (("input", node.input_descs, inputs, node.input_names),
                                       ("output", node.output_descs, outputs, node.output_names)):
        for index, desc in descs.items():
            value = values[index] if index < len(values) else None
            subject = f"{node.GetOpType()} '{node.GetName()}': {kind} desc '{names[index]}'"
            if value is None:
                raise GraphError(f"{subject}: the {kind} is absent, but a desc {desc} was declared",
                                 node=node.GetName(), location=node.location)
            if not _matches(desc, value.type):
                raise GraphError(f"{subject}: expected {value.type} (what the graph {'gives it' if kind == 'input' else 'infers'}"
                                 f"), got {desc.data_type_name()}{desc.GetShape().GetDims()} "
                                 f"(update_{kind}_desc_{names[index]})", node=node.GetName(), location=node.location)
