"""A small builder for the standard-op bodies of our ops' ONNX FunctionProtos.

Every method adds nodes and returns the new value names, so a lowering reads like the
spec's formulas. ``attr_*`` read the calling node's attributes (reference attributes), so
one body serves every attribute value; ONNX Runtime folds the constant parts away.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto, TensorProto, helper, numpy_helper

__all__ = ["Body", "OPSET"]

OPSET = 18
"""The standard opset of exported models and of every function body."""


class Body:
    def __init__(self) -> None:
        self.nodes: list = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"_{hint.lower()}{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs) -> str | tuple[str, ...]:
        names = tuple(self.fresh(op_type) for _ in range(outputs))
        self.nodes.append(helper.make_node(op_type, list(inputs), list(names), **attrs))
        return names[0] if outputs == 1 else names

    def output(self, op_type: str, name: str, *inputs: str, **attrs) -> str:
        """A node that writes a function output ``name``."""
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attrs))
        return name

    # -- constants ---------------------------------------------------------------------------
    def const(self, value, dtype=np.int64) -> str:
        tensor = numpy_helper.from_array(np.asarray(value, dtype))
        return self.op("Constant", value=tensor)

    def ints(self, *values: int) -> str:
        return self.const(list(values))

    def f32(self, value: float) -> str:
        return self.const(value, np.float32)

    def _attr(self, name: str, kind: int, field: str) -> str:
        out = self.fresh("attr")
        node = helper.make_node("Constant", [], [out])
        node.attribute.append(helper.make_attribute_ref(field, kind, ref_attr_name=name))
        self.nodes.append(node)
        return out

    def attr_int(self, name: str) -> str:
        """Scalar int64 tensor holding the calling node's Int attribute."""
        return self._attr(name, AttributeProto.INT, "value_int")

    def attr_ints(self, name: str) -> str:
        return self._attr(name, AttributeProto.INTS, "value_ints")

    def attr_float(self, name: str) -> str:
        return self._attr(name, AttributeProto.FLOAT, "value_float")

    # -- shorthands ----------------------------------------------------------------------------
    def to_float(self, x: str) -> str:
        return self.op("Cast", x, to=TensorProto.FLOAT)

    def to_int64(self, x: str) -> str:
        return self.op("Cast", x, to=TensorProto.INT64)

    def dim(self, x: str, axis: int) -> str:
        """Size of ``axis`` of ``x`` as a 1-element int64 tensor."""
        return self.op("Shape", x, start=-1) if axis == -1 else self.op("Shape", x, start=axis, end=axis + 1)

    def scalar(self, x: str) -> str:
        return self.op("Squeeze", x, self.ints(0))

    def concat(self, *xs: str, axis: int = 0) -> str:
        return self.op("Concat", *xs, axis=axis)

    def unsqueeze(self, x: str, *axes: int) -> str:
        return self.op("Unsqueeze", x, self.ints(*axes))

    def reshape(self, x: str, *dims: str | int, allowzero: bool = False) -> str:
        """Reshape to the concatenation of 1-element shape tensors (names) or ints. ``allowzero``: a 0 in the shape
        is a dimension of size 0 (ONNX's default copies the input's dimension there instead); no -1 then."""
        parts = [d if isinstance(d, str) else self.ints(d) for d in dims]
        return self.op("Reshape", x, self.concat(*parts), **({"allowzero": 1} if allowzero else {}))

    def slice(self, x: str, start: str, end: str, axis: int) -> str:
        return self.op("Slice", x, start, end, self.ints(axis))

    def where(self, cond: str, a: str, b: str) -> str:
        return self.op("Where", cond, a, b)

    def round_trip(self, x: str, like: str) -> str:
        """Round float32 ``x`` to ``like``'s dtype and widen back (an intermediate rounding)."""
        return self.to_float(self.op("CastLike", x, like))

    def sum(self, x: str, *axes: int, keepdims: int = 0) -> str:
        return self.op("ReduceSum", x, self.ints(*axes), keepdims=keepdims)
