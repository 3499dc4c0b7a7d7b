"""Export a geir Graph as an ONNX model any ONNX tool understands and any ONNX Runtime runs.

Each of our nodes becomes one node of domain ``ai.cann`` (GE IR op type, input/output names,
attributes), and the model carries one FunctionProto per used op whose body is standard ONNX
ops (float32 inside), so no geir is needed to run it. Every value gets its full type in
``value_info``; symbolic dims are ``dim_param``.
"""

from __future__ import annotations

import os

import numpy as np
from onnx import FunctionProto, ModelProto, NodeProto, TensorProto, ValueInfoProto, checker, helper, numpy_helper, shape_inference

from ._onnx_body import OPSET, Body
from ._registry import get_schema
from ._lowering import LOWERINGS, LoweringSpec
from ._core import CANN_DOMAIN, Graph, Node, Value, unused_name
from ._errors import GraphError, first_line
from ._standard import export_attributes
from ._files import write_file
from ._onnx_schemas import register_onnx_schemas
from ._onnx_types import attribute_to_onnx, value_info
from ._subgraphs import captured_names, rename_in_node
from ._types import TensorType

__all__ = ["IR_VERSION", "save_onnx", "to_onnx"]

IR_VERSION = 9
"""ONNX IR version of exported models (function attribute defaults need 9)."""


def to_onnx(graph: Graph) -> ModelProto:
    """The graph as an ONNX ModelProto that passes ``onnx.checker.check_model(full_check=True)``."""
    register_onnx_schemas()
    nodes: list[NodeProto] = []
    specs: dict[str, tuple[LoweringSpec, str]] = {}
    added = _Added(graph, {v.name for v in graph.values()} | set(graph.constants) | {n.name for n in graph.nodes})
    for node in graph.topological_order():
        if node.domain == CANN_DOMAIN:
            schema = get_schema(node.op_type, node.domain)
            spec = lowering_spec(node, schema)
            previous = specs.setdefault(node.op_type, (spec, node.name))
            if previous[0] != spec:
                raise GraphError(
                    f"{node.op_type} '{node.name}': cannot export: its ONNX function body would differ from the one of "
                    f"'{previous[1]}' ({_describe_spec(spec)} vs {_describe_spec(previous[0])}); a model holds one "
                    f"function per op, and ONNX Runtime cannot branch on absent inputs", node=node.name,
                    location=node.location)
            attributes = [attribute_to_onnx(a.name, a.kind.value, node.attributes[a.name]) for a in schema.attributes]
        else:
            given = export_attributes(node.op_type, node.attributes, node.inputs[0].type if node.inputs and
                                      node.inputs[0] is not None else None)
            attributes = [helper.make_attribute(k, v) for k, v in given.items()]
        names = _input_names(node)
        if node.domain == "" and node.op_type == "Slice":
            names = _slice_inputs(node, names, graph, added)
        nodes += added.take_nodes()
        proto = helper.make_node(node.op_type, names,
                                 [v.name if v is not None else "" for v in node.outputs], name=node.name,
                                 domain=node.domain)
        proto.attribute.extend(attributes)
        if node.domain != CANN_DOMAIN:   # its subgraphs read the captured values (ir._subgraphs) by their names now
            captured = captured_names(node.attributes)
            rename_in_node(proto, dict(zip(captured, (v.name for v in node.inputs[len(node.inputs) - len(captured):]))))
        nodes.append(proto)
    outputs = {v.name for v in graph.outputs}
    inputs = {v.name for v in graph.inputs}

    def typed(v: Value) -> ValueInfoProto:   # one dim_param per class of symbols declared equal
        dims = [graph.symbols.canonical(d) if isinstance(d, str) else d for d in v.type.shape]
        return value_info(v.name, TensorType(v.type.dtype, dims))

    inner = [typed(v) for v in graph.values()
             if v.name not in outputs and v.name not in inputs and v.name not in graph.constants]
    initializers = [numpy_helper.from_array(array, name) for name, array in graph.constants.items()]
    initializers += [numpy_helper.from_array(graph.defaults[v.name], v.name) for v in graph.inputs
                     if v.name in graph.defaults]    # an input's default: a same-name initializer (IR >= 4)
    onnx_graph = helper.make_graph(nodes, graph.name, [typed(v) for v in graph.inputs],
                                   [typed(v) for v in graph.outputs], initializer=initializers + added.initializers,
                                   value_info=inner + added.value_info)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(CANN_DOMAIN, 1)] if specs else [])
    functions = [_function(spec) for spec, _ in specs.values()]
    model = helper.make_model(onnx_graph, opset_imports=opsets, functions=functions, ir_version=IR_VERSION,
                              producer_name="geir")
    try:
        checker.check_model(model, full_check=True)
    except shape_inference.InferenceError as exc:   # e.g. a pool's ceil_mode size, see ir/_standard.py
        raise GraphError(f"graph '{graph.name}': cannot export at opset {OPSET}: ONNX's shape inference disagrees "
                         f"with the graph's types: {first_line(exc)}") from None
    return model


def save_onnx(graph: Graph, path: str | os.PathLike) -> None:
    """Write ``to_onnx(graph)`` to ``path``. The model is exported and serialised first and the file replaced
    only when all of it is written, so a graph that cannot be exported (or a full disk) leaves ``path`` as it was."""
    write_file(path, to_onnx(graph).SerializeToString())


def _input_names(node: Node) -> list[str]:
    """The node's input names, "" for an absent optional input. A standard op's trailing absent inputs are left out
    (both mean "absent" to ONNX, yet ONNX Runtime's Squeeze stops on a trailing "": "Axes input is null"); a call
    of our ops' functions keeps them, as onnx.reference wants one name per formal input of a function."""
    inputs = list(node.inputs)
    if node.domain != CANN_DOMAIN:    # the values its subgraphs read (ir._subgraphs) are no inputs in ONNX
        inputs = inputs[:len(inputs) - len(captured_names(node.attributes))]
    while node.domain != CANN_DOMAIN and inputs and inputs[-1] is None:
        inputs.pop()
    return [v.name if v is not None else "" for v in inputs]


class _Added:
    """Nodes, initializers and value_info the export adds to state a node's meaning for ONNX Runtime, under names no
    value or node of the graph has."""

    def __init__(self, graph: Graph, taken: set[str]) -> None:
        self.graph, self.taken = graph, taken
        self.nodes: list[NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.value_info: list[ValueInfoProto] = []

    def name(self, stem: str) -> str:
        name = unused_name(stem, self.taken)
        self.taken.add(name)
        return name

    def constant(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def node(self, op_type: str, inputs: list[str], stem: str, like: Value, dtype: int) -> str:
        """One standard node with one output of ``like``'s shape and element type ``dtype``."""
        out = self.name(stem)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out))
        dims = [self.graph.symbols.canonical(d) if isinstance(d, str) else d for d in like.type.shape]
        self.value_info.append(helper.make_tensor_value_info(out, dtype, dims))
        return out

    def take_nodes(self) -> list[NodeProto]:
        nodes, self.nodes = self.nodes, []
        return nodes


_INT_MAXES = (np.iinfo(np.int32).max, np.iinfo(np.int64).max)
"""Ends that ONNX Runtime reads as "through index 0" with a negative step; the spec clamps them to dim - 1."""


def _slice_inputs(node: Node, inputs: list[str], graph: Graph, added: _Added) -> list[str]:
    """A Slice's input names with its ends canonicalised: under a negative step, ONNX clamps an end of INT32_MAX or
    INT64_MAX to dim - 1 (nothing read from a start at dim - 1), as it does any end >= dim, but ONNX Runtime reads
    these two values as "through index 0". An end of -1 means dim - 1 to both, for every dim, so those ends are
    written as -1: a new initializer where ends and steps are constants, a Where over the fed values otherwise."""
    ends, steps = node.inputs[2], node.inputs[4] if len(node.inputs) > 4 else None
    if ends is None or steps is None:
        return inputs                              # no steps: all are 1
    fixed = {v.name: graph.constants[v.name] for v in (ends, steps) if v.name in graph.constants}
    if steps.name in fixed and (fixed[steps.name] > 0).all():
        return inputs
    if ends.name in fixed and not np.isin(fixed[ends.name], _INT_MAXES).any():
        return inputs
    stem, ends_dtype = f"{node.name}_ends", ends.type.dtype.numpy
    if len(fixed) == 2:
        end_array, step_array = fixed[ends.name], fixed[steps.name]
        if end_array.shape != step_array.shape:
            return inputs                          # not a valid Slice: the runtimes refuse it as it is
        clamped = np.where((step_array < 0) & np.isin(end_array, _INT_MAXES), -1, end_array).astype(ends_dtype)
        return inputs[:2] + [added.constant(stem, clamped)] + inputs[3:]
    limits = [m for m in _INT_MAXES if m <= np.iinfo(ends_dtype).max]
    big = added.node("Equal", [ends.name, added.constant(f"{stem}_max", np.array(limits[0], ends_dtype))],
                     f"{stem}_is_max", ends, TensorProto.BOOL)
    if len(limits) == 2:
        other = added.node("Equal", [ends.name, added.constant(f"{stem}_max", np.array(limits[1], ends_dtype))],
                           f"{stem}_is_max", ends, TensorProto.BOOL)
        big = added.node("Or", [big, other], f"{stem}_is_max", ends, TensorProto.BOOL)
    backward = added.node("Less", [steps.name, added.constant(f"{stem}_zero", np.array(0, steps.type.dtype.numpy))],
                          f"{stem}_backward", steps, TensorProto.BOOL)
    replace = added.node("And", [backward, big], f"{stem}_clamped", ends, TensorProto.BOOL)
    canonical = added.node("Where", [replace, added.constant(f"{stem}_minus_one", np.array(-1, ends_dtype)),
                                     ends.name], f"{stem}_canonical", ends, ends.type.dtype.onnx)
    return inputs[:2] + [canonical] + inputs[3:]


def lowering_spec(node: Node, schema) -> LoweringSpec:
    """What our op's exported function body depends on: the optional inputs present, the structural attributes,
    the formal names. Export writes one body per op, so two nodes of one op with unequal specs cannot both export."""
    if (node.domain, node.op_type) not in LOWERINGS:
        raise GraphError(f"{node.op_type} '{node.name}': no ONNX lowering is declared for this op", node=node.name)
    _, structural = LOWERINGS[(node.domain, node.op_type)]
    present = frozenset(s.name for s, v in zip(schema.inputs, node.inputs) if s.optional and v is not None)
    return LoweringSpec(node.op_type, present, tuple((a, node.attributes[a]) for a in structural),
                        tuple(s.name for s in schema.inputs), tuple(s.name for s in schema.outputs))


def _describe_spec(spec) -> str:
    parts = ["inputs " + ", ".join(sorted(spec.present)) if spec.present else "no optional inputs"]
    parts += [f"{k}={v!r}" for k, v in spec.structure]
    return "; ".join(parts)


def _function(spec) -> FunctionProto:
    schema = get_schema(spec.op_type)
    body = Body()
    LOWERINGS[(schema.domain, schema.op_type)][0](body, spec)
    defaults = [attribute_to_onnx(a.name, a.kind.value, a.default) for a in schema.attributes if not a.required]
    required = [a.name for a in schema.attributes if a.required]
    return helper.make_function(CANN_DOMAIN, spec.op_type, list(spec.inputs), list(spec.outputs), body.nodes,
                                [helper.make_opsetid("", OPSET)], attributes=required, attribute_protos=defaults,
                                doc_string=schema.doc)
