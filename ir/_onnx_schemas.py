"""Registration of our ops with ``onnx.defs``, so ONNX tools (checker, shape inference) know them.

Shape inference delegates to the geir schema's own ``infer`` (one declaration per op).
"""

from __future__ import annotations

from onnx import TypeProto, defs, helper

from ._registry import all_schemas
from ._schema import InferContext
from ._onnx_types import attribute_from_onnx, tensor_type_from_onnx

__all__ = ["register_onnx_schemas"]

_ATTR_TYPES = {"Int": defs.OpSchema.AttrType.INT, "Float": defs.OpSchema.AttrType.FLOAT,
               "Bool": defs.OpSchema.AttrType.INT, "String": defs.OpSchema.AttrType.STRING,
               "ListInt": defs.OpSchema.AttrType.INTS}
_registered = False


def _onnx_type(dtype) -> str:
    return "tensor(float)" if dtype.value == "float32" else f"tensor({dtype.value})"


def register_onnx_schemas() -> None:
    """Register every ai.cann op with onnx.defs (once per process)."""
    global _registered
    if _registered:
        return
    for schema in all_schemas():
        if defs.has(schema.op_type, schema.domain):
            continue
        option = defs.OpSchema.FormalParameterOption
        inputs = [defs.OpSchema.FormalParameter(s.name, f"T{i}", s.doc, param_option=option.Optional if s.optional
                                                else option.Single) for i, s in enumerate(schema.inputs)]
        outputs = [defs.OpSchema.FormalParameter(s.name, f"O{i}", s.doc, param_option=option.Optional if s.optional
                                                 else option.Single) for i, s in enumerate(schema.outputs)]
        constraints = [(f"T{i}", [_onnx_type(d) for d in s.dtypes], f"dtypes of {s.name}")
                       for i, s in enumerate(schema.inputs)]
        floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]   # an output's dtype: a float or an input's
        produced = floats + sorted({_onnx_type(d) for s in schema.inputs for d in s.dtypes} - set(floats))
        constraints += [(f"O{i}", produced, f"dtype of {s.name}") for i, s in enumerate(schema.outputs)]
        attributes = [defs.OpSchema.Attribute(a.name, _ATTR_TYPES[a.kind.value], a.doc, required=a.required)
                      for a in schema.attributes]
        onnx_schema = defs.OpSchema(schema.op_type, schema.domain, schema.version, schema.doc, inputs=inputs,
                                    outputs=outputs, type_constraints=constraints, attributes=attributes)
        onnx_schema.set_type_and_shape_inference_function(_inference_for(schema))
        defs.register_schema(onnx_schema)
    _registered = True


def _inference_for(schema):
    def infer(ctx) -> None:
        types = []
        for i, spec in enumerate(schema.inputs):
            if i >= ctx.get_num_inputs() or not ctx.has_input(i):
                types.append(None)
                continue
            tp = ctx.get_input_type(i)
            if tp is None or not tp.tensor_type.HasField("shape"):
                return  # not enough information: leave the outputs unknown
            types.append(tensor_type_from_onnx(tp, f"{schema.op_type} input {i} '{spec.name}'"))
        given = {}
        for spec in schema.attributes:
            attr = ctx.get_attribute(spec.name)
            if attr is not None:
                given[spec.name] = attribute_from_onnx(attr, spec.kind.value)
        attributes = schema.bind_attributes(given, schema.op_type)
        out = schema.infer_types(InferContext(schema, schema.op_type, types, attributes))
        for i, t in enumerate(out):
            if t is not None and i < ctx.get_num_outputs():
                ctx.set_output_type(i, _type_proto(t))
    return infer


def _type_proto(t) -> TypeProto:
    return helper.make_tensor_type_proto(t.dtype.onnx, None if t.dims is None else list(t.dims))
