"""Standard ONNX ops (domain ""), declared by ``onnx.defs`` rather than by us.

An imported model may mix standard ops with ours; they are first-class nodes: the adapter
below gives them the interface of an OpSchema, with arity from the onnx schema, attribute
checks by ``onnx.checker.check_node`` and types by onnx's own shape inference.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import checker, defs, helper, numpy_helper, shape_inference

from geir._dtypes import DType
from geir._errors import GraphError, SourceLocation, format_rule_message
from geir._onnx_types import tensor_type_from_onnx
from geir._types import TensorType

from ._onnx_body import OPSET
from ._schema import InferContext, InputSpec, OutputSpec

__all__ = ["StandardOpSchema", "standard_schema"]

_ALL = tuple(DType)
_CACHE: dict[str, StandardOpSchema] = {}


class StandardOpSchema:
    """An ONNX standard op seen through the OpSchema interface the builder, passes and runtime use."""

    domain = ""
    version = OPSET
    validate = None
    attributes: tuple = ()

    def __init__(self, op_type: str) -> None:
        try:
            self.onnx = defs.get_schema(op_type, OPSET, "")
        except defs.SchemaError:
            raise GraphError(f"[SCH-1] {op_type}: op type: expected a standard ONNX op of opset {OPSET}, got unknown "
                             f"op '{op_type}'", rule="SCH-1") from None
        self.op_type = op_type
        self.doc = self.onnx.doc or ""
        option = defs.OpSchema.FormalParameterOption
        self.inputs = tuple(InputSpec(p.name, _ALL, optional=p.option != option.Single) for p in self.onnx.inputs)
        self.outputs = tuple(OutputSpec(p.name, optional=p.option != option.Single) for p in self.onnx.outputs)
        if any(p.option == option.Variadic for p in self.onnx.outputs):
            raise GraphError(f"{op_type}: standard ops with a variadic number of outputs are not supported")
        self.max_inputs = self.onnx.max_input

    def input_index(self, key: int | str) -> int:
        return key if isinstance(key, int) else [s.name for s in self.inputs].index(key)

    def output_index(self, key: int | str) -> int:
        return key if isinstance(key, int) else [s.name for s in self.outputs].index(key)

    def raise_error(self, rule: str, node: str, subject: str, expected: object, got: object,
                    location: SourceLocation | None) -> None:
        raise GraphError(format_rule_message(rule, self.op_type, node, subject, expected, got), rule=rule, node=node,
                         location=location)

    def bind_attributes(self, given: dict[str, Any], node: str, location: SourceLocation | None = None) -> dict:
        """Attributes are kept as given; ``onnx.checker.check_node`` validates them (SCH-3)."""
        proto = helper.make_node(self.op_type, [f"in{i}" for i in range(max(1, self.onnx.min_input))],
                                 [f"out{i}" for i in range(max(1, self.onnx.min_output))], **given)
        context = checker.C.CheckerContext()
        context.ir_version = onnx.IR_VERSION
        context.opset_imports = {"": OPSET}
        try:
            checker.check_node(proto, context)
        except checker.ValidationError as exc:
            first = str(exc).strip().splitlines()[0]
            raise GraphError(f"[SCH-3] {self.op_type} '{node}': attributes: {first}", rule="SCH-3", node=node,
                             location=location) from None
        return dict(given)

    def check_signature(self, input_types, node: str, location: SourceLocation | None = None) -> None:
        count = len(input_types)
        while count and input_types[count - 1] is None:
            count -= 1
        if not self.onnx.min_input <= count <= self.onnx.max_input:
            self.raise_error("SCH-2", node, "inputs", f"{self.onnx.min_input} to {self.onnx.max_input}", count,
                             location)

    def infer_types(self, ctx: InferContext) -> tuple[TensorType | None, ...]:
        names = [f"in{i}" if t is not None else "" for i, t in enumerate(ctx.inputs)]
        proto = helper.make_node(self.op_type, names, [f"out{i}" for i in range(len(self.outputs))], **ctx.attributes)
        types = {n: helper.make_tensor_type_proto(t.dtype.onnx, list(t.shape)) for n, t in zip(names, ctx.inputs)
                 if t is not None}
        data = {n: numpy_helper.from_array(v) for n, v in zip(names, ctx.input_values) if v is not None}
        try:
            inferred = shape_inference.infer_node_outputs(self.onnx, proto, types, input_data=data, opset_imports=[
                helper.make_opsetid("", OPSET)])
        except Exception as exc:  # onnx raises several types; all mean the same for the user
            raise GraphError(f"{self.op_type} '{ctx.node}': ONNX shape inference failed: {exc}", node=ctx.node,
                             location=ctx.location) from None
        out: list[TensorType | None] = []
        for i, spec in enumerate(self.outputs):
            tp = inferred.get(f"out{i}")
            if tp is None:
                raise GraphError(f"{self.op_type} '{ctx.node}': output {i} '{spec.name}': ONNX shape inference gave "
                                 f"no type", node=ctx.node, location=ctx.location)
            symbol = "".join(ch if ch.isalnum() else "_" for ch in f"{ctx.node}_{spec.name}")
            out.append(tensor_type_from_onnx(tp, f"{self.op_type} '{ctx.node}' output {i} '{spec.name}'", symbol))
        return tuple(out)


def standard_schema(op_type: str) -> StandardOpSchema:
    if op_type not in _CACHE:
        _CACHE[op_type] = StandardOpSchema(op_type)
    return _CACHE[op_type]
