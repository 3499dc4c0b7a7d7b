"""Export a geir Graph as an ONNX model any ONNX tool understands and any ONNX Runtime runs.

Each of our nodes becomes one node of domain ``ai.cann`` (GE IR op type, input/output names,
attributes), and the model carries one FunctionProto per used op whose body is standard ONNX
ops (float32 inside), so no geir is needed to run it. Every value gets its full type in
``value_info``; symbolic dims are ``dim_param``.
"""

from __future__ import annotations

import os

import numpy as np
from onnx import (FunctionProto, GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto, checker, defs, helper,
                  numpy_helper, shape_inference, version_converter)

from ._onnx_body import OPSET, Body
from ._registry import get_schema
from ._lowering import LOWERINGS, LoweringSpec
from ._core import CANN_DOMAIN, Graph, Node, Value, unused_name
from ._errors import GraphError, first_line
from ._standard import export_attributes
from ._files import write_file
from ._onnx_schemas import register_onnx_schemas
from ._onnx_types import attribute_to_onnx, value_info
from ._subgraphs import captured_names, rename_in_node, subgraphs_of
from ._types import TensorType

__all__ = ["IR_VERSION", "runtime_model", "save_onnx", "to_onnx"]

IR_VERSION = 9
"""ONNX IR version of exported models (function attribute defaults need 9)."""


def to_onnx(graph: Graph) -> ModelProto:
    """The graph as an ONNX ModelProto that passes ``onnx.checker.check_model(full_check=True)``.

    The model's standard opset is the newest its nodes follow (``Node.version``), at least ``OPSET`` when it holds
    our ops (their function bodies need it); our bodies are written at that opset too. A standard node of an older
    opset whose op ONNX has changed since is lifted to the model's opset by ``onnx.version_converter``: the only
    conversion the export does, and only where one model cannot hold both definitions.

    ONNX files give every graph input and output a shape: a graph with one of unknown rank is a GraphError naming
    it (the ONNX Runtime runtime still runs it, ``runtime_model``)."""
    unranked = [f"{kind} '{v.name}'" for kind, values in (("input", graph.inputs), ("output", graph.outputs))
                for v in values if v.type.is_tensor and not v.type.has_rank]
    if unranked:
        raise GraphError(f"graph '{graph.name}': cannot export: ONNX files give every graph input and output a "
                         f"shape, and {', '.join(unranked)} {'has' if len(unranked) == 1 else 'have'} an unknown rank")
    return runtime_model(graph)


def runtime_model(graph: Graph) -> ModelProto:
    """``to_onnx(graph)`` as an engine takes it: graph inputs and outputs of unknown rank are written without a shape
    (ONNX Runtime runs that; onnx's checker, which wants their shapes, is then left out)."""
    register_onnx_schemas()
    opset = export_opset(graph)
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
        if node.domain == "" and node.op_type == "Slice" and len(node.inputs) >= 3:   # Slice-1: bounds are attributes
            names = _slice_inputs(node, names, graph, added)
        nodes += added.take_nodes()
        proto = helper.make_node(node.op_type, names,
                                 [v.name if v is not None else "" for v in node.outputs], name=node.name,
                                 domain=node.domain)
        proto.attribute.extend(attributes)
        if node.domain != CANN_DOMAIN:   # its subgraphs read the captured values (ir._subgraphs) by their names now
            captured = captured_names(node.attributes)
            rename_in_node(proto, dict(zip(captured, (v.name for v in node.inputs[len(node.inputs) - len(captured):]))))
            version = OPSET if node.version is None else node.version
            if _changed_since(proto, version, opset):
                nodes += _lifted(proto, node, version, opset, added)
                continue
        nodes.append(proto)
    outputs = {v.name for v in graph.outputs}
    inputs = {v.name for v in graph.inputs}

    def typed(v: Value) -> ValueInfoProto:   # one dim_param per class of symbols declared equal
        return value_info(v.name, _canonical(graph, v.type))

    inner = [typed(v) for v in graph.values()
             if v.name not in outputs and v.name not in inputs and v.name not in graph.constants]
    initializers = [numpy_helper.from_array(array, name) for name, array in graph.constants.items()]
    initializers += [numpy_helper.from_array(graph.defaults[v.name], v.name) for v in graph.inputs
                     if v.name in graph.defaults]    # an input's default: a same-name initializer (IR >= 4)
    onnx_graph = helper.make_graph(nodes, graph.name, [typed(v) for v in graph.inputs],
                                   [typed(v) for v in graph.outputs], initializer=initializers + added.initializers,
                                   value_info=inner + added.value_info)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(CANN_DOMAIN, 1)] if specs else [])
    others: dict[str, int] = {}     # ONNX's other domains and foreign ones: the newest version their nodes follow
    for node in graph.nodes:
        if node.domain not in ("", CANN_DOMAIN):
            others[node.domain] = max(others.get(node.domain, 1), node.version or 1)
    opsets += [helper.make_opsetid(d, v) for d, v in sorted(others.items())]
    functions = [_function(spec, opset) for spec, _ in specs.values()]
    model = helper.make_model(onnx_graph, opset_imports=opsets, functions=functions, ir_version=IR_VERSION,
                              producer_name="geir")
    if not all(v.type.has_rank or not v.type.is_tensor for v in list(graph.inputs) + list(graph.outputs)):
        return model
    try:
        checker.check_model(model, full_check=True)
    except shape_inference.InferenceError as exc:   # e.g. a pool's ceil_mode size, see ir/_pool_shapes.py
        if not _fails_untyped(model):
            raise GraphError(f"graph '{graph.name}': cannot export at opset {opset}: ONNX's shape inference disagrees "
                             f"with the graph's types: {first_line(exc)}") from None
        checker.check_model(model)     # ONNX's inference fails on the model whatever its types: its own limit
    return model


def _fails_untyped(model: ModelProto) -> bool:
    """Whether ONNX's strict shape inference fails on ``model`` without the types geir states (its value_info and
    output shapes): then a failure is a limit of ONNX's inference (MeanVarianceNormalization-13's function body,
    say), not a disagreement with geir."""
    bare = ModelProto()
    bare.CopyFrom(model)
    del bare.graph.value_info[:]
    for output in bare.graph.output:
        if output.type.HasField("tensor_type"):
            output.type.tensor_type.ClearField("shape")
    try:
        shape_inference.infer_shapes(bare, strict_mode=True)
    except shape_inference.InferenceError:
        return True
    return False


def _canonical(graph: Graph, t: TensorType) -> TensorType:
    """``t`` with each symbol replaced by its class's canonical one (one dim_param per class declared equal)."""
    if t.dims is None:
        return t
    return t.with_shape(graph.symbols.canonical(d) if isinstance(d, str) else d for d in t.dims)


def export_opset(graph: Graph) -> int:
    """The standard opset ``to_onnx`` writes: the newest any standard node follows, at least ``OPSET`` when the graph
    holds our ops, ``OPSET`` for a graph without standard nodes."""
    versions = {OPSET if n.version is None else n.version for n in graph.nodes if n.domain == ""}
    if not versions or any(n.domain == CANN_DOMAIN for n in graph.nodes):
        versions.add(OPSET)
    return max(versions)


def _op_types(nodes) -> set[str]:
    """The standard op types of ``nodes`` and of every node in their subgraphs."""
    found: set[str] = set()
    for node in nodes:
        if node.domain in ("", "ai.onnx"):
            found.add(node.op_type)
        for attribute in node.attribute:
            for subgraph in subgraphs_of(attribute):
                found |= _op_types(subgraph.node)
    return found


def _changed_since(proto: NodeProto, version: int, opset: int) -> bool:
    """Whether ONNX defines any op of ``proto`` (or of its subgraphs) differently at ``opset`` than at ``version``."""
    if version == opset:
        return False
    for op_type in _op_types([proto]):
        try:
            if defs.get_schema(op_type, version, "").since_version != defs.get_schema(op_type, opset, "").since_version:
                return True
        except defs.SchemaError:
            return True
    return False


def _lifted(proto: NodeProto, node: Node, version: int, opset: int, added: _Added) -> list[NodeProto]:
    """``proto`` (a node of standard opset ``version``) as nodes of ``opset``, by ``onnx.version_converter`` on a
    one-node model; the values the converter adds get names no value of the graph has."""
    read = {v.name: v for v in node.inputs if v is not None}    # its inputs and what its subgraphs read
    declared = [value_info(v.name, v.type) for v in read.values()]
    results = [value_info(v.name, v.type) for v in node.outputs if v is not None]
    single = helper.make_model(helper.make_graph([proto], node.name, declared, results),
                               opset_imports=[helper.make_opsetid("", version)])
    try:
        lifted: GraphProto = version_converter.convert_version(single, opset).graph
    except Exception as exc:   # the converter raises several types; all mean the same for the user
        raise GraphError(f"{node.op_type} '{node.name}': cannot export: the node follows standard opset {version}, the "
                         f"model is written at opset {opset} (the newest of its nodes, at least {OPSET} with our ops), "
                         f"and onnx's version converter cannot lift it: {type(exc).__name__}: {first_line(exc)}",
                         node=node.name, location=node.location) from None
    boundary = {n for n in proto.input} | {n for n in proto.output}
    renamed: dict[str, str] = {}
    for new in lifted.node:
        for k, name in enumerate(new.output):
            if name and name not in boundary:
                renamed[name] = new.output[k] = added.name(f"{node.name}_{name.lstrip('_')}")
        for k, name in enumerate(new.input):
            new.input[k] = renamed.get(name, name)
        if new.name != proto.name:
            new.name = added.name(new.name or f"{node.name}_{new.op_type}")
    return list(lifted.node)


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
        self.value_info.append(value_info(out, _canonical(self.graph, like.type.with_dtype(dtype))))
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


def _function(spec, opset: int) -> FunctionProto:
    schema = get_schema(spec.op_type)
    body = Body()
    LOWERINGS[(schema.domain, schema.op_type)][0](body, spec)
    defaults = [attribute_to_onnx(a.name, a.kind.value, a.default) for a in schema.attributes if not a.required]
    required = [a.name for a in schema.attributes if a.required]
    return helper.make_function(CANN_DOMAIN, spec.op_type, list(spec.inputs), list(spec.outputs), body.nodes,
                                [helper.make_opsetid("", opset)], attributes=required, attribute_protos=defaults,
                                doc_string=schema.doc)
