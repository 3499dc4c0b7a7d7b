"""Standard ops without a VJP rule written out as ONNX's own function body, so that ``geir.grad`` can
differentiate them: Attention (opset 23), and any other op ONNX defines by a function (Swish, Celu, Shrink, ...).
Our ops are written out the same way, as the body export gives them (``our_function_body``), where a device has no
kernel for them (``passes.target_forms``).

ONNX states such an op's meaning by a body of simpler ops (a context-dependent body is built from the node's
attributes and input types, as ``onnx.defs`` does for Attention). Written out, the body computes what the op
computes by definition, and every op in it has a rule or is expanded in turn (to a bounded depth). Only nodes on
the way from the inputs differentiated to the outputs are expanded; the others stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
from onnx import AttributeProto, defs, helper, shape_inference

from ..ir._core import Graph, Node, Value
from ..ir._editor import GraphEditor
from ..ir._errors import GraphError
from ..ir._lowering import LOWERINGS
from ..ir._onnx_export import lowering_spec, runtime_model
from ..ir._onnx_types import attribute_to_onnx, tensor_type_from_onnx, type_proto
from ..ir._types import TensorType
from ..ir._onnx_body import OPSET, Body
from ..ir._standard import standard_schema
from .build import build

__all__ = ["defines_by_body", "expand_functions", "function_body", "our_function_body"]

BodyOf = Callable[[Node], "onnx.FunctionProto | None"]
"""Where a node's body comes from when it is not ONNX's (``our_function_body``)."""

MAX_DEPTH = 4
"""How deep bodies are expanded within bodies (an op of a body that has no rule but a body of its own)."""


def defines_by_body(op_type: str, version: int, domain: str) -> bool:
    """Whether ONNX defines the op at ``version`` by a function body (its own or one built from the node)."""
    try:
        schema = defs.get_schema(op_type, version, domain)
    except defs.SchemaError:
        return False
    return bool(schema.has_function or schema.has_context_dependent_function)


def function_body(op_type: str, version: int, domain: str, attributes: dict[str, Any],
                  input_types: list) -> onnx.FunctionProto | None:
    """ONNX's function body of the op at ``version`` for a node with these attributes and input TensorTypes (None
    for an absent input): its own, with attribute references resolved, or built from the node (context-dependent);
    None when ONNX defines the op by no function."""
    try:
        schema = defs.get_schema(op_type, version, domain)
    except defs.SchemaError:
        return None
    proto = helper.make_node(op_type, [f"in{i}" if t is not None else "" for i, t in enumerate(input_types)],
                             ["out"], domain=domain, **attributes)
    body = onnx.FunctionProto()
    if schema.has_context_dependent_function:
        types = [type_proto(t).SerializeToString() if t is not None else onnx.TypeProto().SerializeToString()
                 for t in input_types]
        versions = [v for v in schema.context_dependent_function_opset_versions if v <= version]
        built = schema.get_context_dependent_function_with_opset_version(
            max(versions) if versions else version, proto.SerializeToString(), types)
        if not built:
            return None
        body.ParseFromString(built)
    elif schema.has_function:
        versions = [v for v in schema.function_opset_versions if v <= version]
        body.ParseFromString(schema.get_function_with_opset_version(max(versions)) if versions else
                             schema.function_body.SerializeToString())
    else:
        return None
    defaults = {name: a.default_value for name, a in schema.attributes.items() if a.default_value.name}
    return _resolved(body, {a.name: a for a in proto.attribute}, defaults)


def our_function_body(node: Node) -> onnx.FunctionProto:
    """The standard-op body that export writes for our op ``node`` (its family's lowering, specialised as export
    specialises it), with the node's attributes in place of the references."""
    spec = lowering_spec(node, node.schema)
    writer = Body()
    LOWERINGS[(node.domain, node.op_type)][0](writer, spec)
    body = onnx.FunctionProto(domain=node.domain, name=node.op_type, input=spec.inputs, output=spec.outputs,
                              opset_import=[helper.make_opsetid("", OPSET)])
    body.node.extend(writer.nodes)
    given = {a.name: attribute_to_onnx(a.name, a.kind.value, node.attributes[a.name])
             for a in node.schema.attributes if a.name in node.attributes}
    return _resolved(body, given, {})


def _resolved(body: onnx.FunctionProto, given: dict[str, AttributeProto],
              defaults: dict[str, AttributeProto]) -> onnx.FunctionProto:
    """``body`` with each attribute reference replaced by the node's value, else the op's default (dropped when
    neither: the inner op's default)."""
    for node in body.node:
        kept = []
        for a in node.attribute:
            if a.ref_attr_name:
                source = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
                if source is None:
                    continue                    # an optional attribute the node does not set: the inner op's default
                resolved = AttributeProto()
                resolved.CopyFrom(source)
                resolved.name = a.name
                kept.append(resolved)
            else:
                kept.append(a)
        del node.attribute[:]
        node.attribute.extend(kept)
    return body


def _emit(b: GraphEditor, op_type: str, domain: str, version: int, attributes: dict[str, Any],
          inputs: list[Value | None], wanted: list[bool], name: str, needs_body: Callable[[str, str], bool],
          depth: int, declared: dict[str, TensorType], body: onnx.FunctionProto | None = None
          ) -> tuple[Value | None, ...] | None:
    """The op's outputs (those ``wanted``) computed by its function body (``body``, else ONNX's), added to ``b``;
    None when it has none."""
    if body is None:
        body = function_body(op_type, version, domain, attributes, [v.type if v is not None else None for v in inputs])
    if body is None:
        return None
    opset = {o.domain: o.version for o in body.opset_import}.get("", version)
    names: dict[str, Value | None] = {"": None}
    for k, formal in enumerate(body.input):
        names[formal] = inputs[k] if k < len(inputs) else None
    for step, inner in enumerate(body.node):
        args = [names[n] if n in names else _missing(op_type, name, n) for n in inner.input]
        given = {a.name: helper.get_attribute_value(a) for a in inner.attribute}
        where = f"{name}/{inner.op_type}_{step}"
        made = None
        if depth < MAX_DEPTH and needs_body(inner.op_type, inner.domain) and any(
                a is not None and a.type.dtype.is_floating for a in args):
            # a floating input: a cotangent may flow through it (a Range over sizes needs none)
            made = _emit(b, inner.op_type, inner.domain, opset, given, args, [bool(o) for o in inner.output], where,
                         needs_body, depth + 1, declared)
        if made is None:
            outputs = [f"{where}_out{k}" for k in range(len(inner.output))]
            result = b.add_node(standard_schema(inner.op_type, len(inner.output), opset, inner.domain), args, given,
                                name=where, output_names=outputs, declared=[declared.get(o) for o in outputs])
            made = result if isinstance(result, tuple) else (result,)
        for output, value in zip(inner.output, made):
            if output:
                names[output] = value
    return tuple(names.get(formal) if keep else None for formal, keep in zip(body.output, wanted))


def _missing(op_type: str, name: str, value: str) -> Value:
    raise GraphError(f"geir.grad: the ONNX function body of {op_type} '{name}' reads '{value}' before it is "
                     f"computed", node=name)


def expand_functions(graph: Graph, nodes: set[int], needs_body: Callable[[str, str], bool],
                     body_of: BodyOf | None = None) -> Graph:
    """A copy of ``graph`` (built) in which each node whose id is in ``nodes`` is written out as its function body
    (``body_of(node)``, by default ONNX's), bodies within bodies too where ``needs_body(op_type, domain)``; every
    value keeps its name (an Identity gives a body's result the node's output name, and its type).

    A body computes its shapes (Reshape to ``Concat(Shape(q)[:2], ...)``), which node-by-node inference does not
    follow: the sizes come from ONNX's shape inference with data propagation over the written-out graph, and the
    copy is made again with them declared (checked on the fed shapes when the graph runs)."""
    first = _expanded(graph, nodes, needs_body, {}, body_of)
    if all(v.type.is_static for v in first.values()):
        return first
    try:
        inferred = shape_inference.infer_shapes(runtime_model(first), data_prop=True).graph
    except Exception:      # onnx raises several types; without its sizes the first copy is what is known
        return first
    declared = {}
    for info in inferred.value_info:
        if info.type.WhichOneof("value") == "tensor_type" and info.type.tensor_type.HasField("shape"):
            declared[info.name] = tensor_type_from_onnx(info.type, f"value '{info.name}'")
    return _expanded(graph, nodes, needs_body, declared, body_of)


def _expanded(graph: Graph, nodes: set[int], needs_body: Callable[[str, str], bool],
              declared: dict[str, TensorType], body_of: BodyOf | None) -> Graph:
    b = GraphEditor(graph.name)

    def rewrite(node: Node, inputs: list[Value | None]) -> tuple[Value | None, ...] | None:
        if id(node) not in nodes:
            return None
        made = _emit(b, node.op_type, node.domain, node.version or OPSET, dict(node.attributes), inputs,
                     [v is not None for v in node.outputs], node.name, needs_body, 0, declared,
                     body_of(node) if body_of is not None else None)
        if made is None:
            return None
        return tuple(None if old is None or new is None else
                     b.add_node(standard_schema("Identity"), [new], {}, name=f"{node.name}/result{k}",
                                output_names=[old.name], declared=[old.type])
                     for k, (old, new) in enumerate(zip(node.outputs, made)))
    b.copy_from(graph, rewrite)
    return build(b)
