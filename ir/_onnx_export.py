"""Export a geir Graph as an ONNX model any ONNX tool understands and any ONNX Runtime runs.

Each of our nodes becomes one node of domain ``ai.cann`` (GE IR op type, input/output names,
attributes), and the model carries one FunctionProto per used op whose body is standard ONNX
ops (float32 inside), so no geir is needed to run it. Every value gets its full type in
``value_info``; symbolic dims are ``dim_param``.
"""

from __future__ import annotations

import os

from onnx import FunctionProto, ModelProto, checker, helper, numpy_helper

from ..schemas import OPSET, get_schema
from ..schemas._onnx_body import Body
from ..schemas.lowering import LOWERINGS, LoweringSpec
from ._core import CANN_DOMAIN, Graph, Node
from ._errors import GraphError
from ._files import write_file
from ._onnx_schemas import register_onnx_schemas
from ._onnx_types import attribute_to_onnx, value_info
from ._types import TensorType

__all__ = ["IR_VERSION", "save_onnx", "to_onnx"]

IR_VERSION = 9
"""ONNX IR version of exported models (function attribute defaults need 9)."""


def to_onnx(graph: Graph) -> ModelProto:
    """The graph as an ONNX ModelProto that passes ``onnx.checker.check_model(full_check=True)``."""
    register_onnx_schemas()
    nodes, specs = [], {}
    for node in graph.topological_order():
        if node.domain == CANN_DOMAIN:
            schema = get_schema(node.op_type, node.domain)
            spec = _lowering_spec(node, schema)
            previous = specs.setdefault(node.op_type, (spec, node.name))
            if previous[0] != spec:
                raise GraphError(
                    f"{node.op_type} '{node.name}': cannot export: its ONNX function body would differ from the one of "
                    f"'{previous[1]}' ({_describe_spec(spec)} vs {_describe_spec(previous[0])}); a model holds one "
                    f"function per op, and ONNX Runtime cannot branch on absent inputs", node=node.name,
                    location=node.location)
            attributes = [attribute_to_onnx(a.name, a.kind.value, node.attributes[a.name]) for a in schema.attributes]
        else:
            attributes = [helper.make_attribute(k, v) for k, v in node.attributes.items()]
        proto = helper.make_node(node.op_type, _input_names(node),
                                 [v.name if v is not None else "" for v in node.outputs], name=node.name,
                                 domain=node.domain)
        proto.attribute.extend(attributes)
        nodes.append(proto)
    outputs = {v.name for v in graph.outputs}
    inputs = {v.name for v in graph.inputs}

    def typed(v) -> object:   # one dim_param per class of symbols declared equal
        dims = [graph.symbols.canonical(d) if isinstance(d, str) else d for d in v.type.shape]
        return value_info(v.name, TensorType(v.type.dtype, dims))

    inner = [typed(v) for v in graph.values()
             if v.name not in outputs and v.name not in inputs and v.name not in graph.constants]
    initializers = [numpy_helper.from_array(array, name) for name, array in graph.constants.items()]
    initializers += [numpy_helper.from_array(graph.defaults[v.name], v.name) for v in graph.inputs
                     if v.name in graph.defaults]    # an input's default: a same-name initializer (IR >= 4)
    onnx_graph = helper.make_graph(nodes, graph.name, [typed(v) for v in graph.inputs],
                                   [typed(v) for v in graph.outputs], initializer=initializers, value_info=inner)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(CANN_DOMAIN, 1)] if specs else [])
    functions = [_function(spec) for spec, _ in specs.values()]
    model = helper.make_model(onnx_graph, opset_imports=opsets, functions=functions, ir_version=IR_VERSION,
                              producer_name="geir")
    checker.check_model(model, full_check=True)
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
    while node.domain != CANN_DOMAIN and inputs and inputs[-1] is None:
        inputs.pop()
    return [v.name if v is not None else "" for v in inputs]


def _lowering_spec(node: Node, schema):
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
