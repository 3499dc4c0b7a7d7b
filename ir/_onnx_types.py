"""Conversions between geir types/attributes and their ONNX protobuf forms."""

from __future__ import annotations

from typing import Any

from onnx import AttributeProto, TensorProto, TypeProto, ValueInfoProto, helper

from ._dtypes import as_dtype
from ._errors import GraphError
from ._types import TensorType

__all__ = ["attribute_from_onnx", "attribute_to_onnx", "tensor_type_from_onnx", "type_proto", "value_info"]

_KIND_TO_ONNX = {"Int": AttributeProto.INT, "Float": AttributeProto.FLOAT, "Bool": AttributeProto.INT,
                 "String": AttributeProto.STRING, "ListInt": AttributeProto.INTS}


def value_info(name: str, t: TensorType) -> ValueInfoProto:
    """A ValueInfoProto with full shape (none for an unknown rank); symbols become ``dim_param``."""
    return helper.make_value_info(name, type_proto(t))


def type_proto(t: TensorType) -> TypeProto:
    """The TypeProto of ``t`` (no shape for an unknown rank; a sequence or optional of its element type)."""
    tensor = helper.make_tensor_type_proto(t.dtype.onnx, None if t.dims is None else list(t.dims))
    if t.kind in ("sequence", "optional_sequence"):
        tensor = helper.make_sequence_type_proto(tensor)
    return helper.make_optional_type_proto(tensor) if t.kind.startswith("optional") else tensor


def tensor_type_from_onnx(tp: TypeProto, what: str, unknown_dim: str | None = None) -> TensorType:
    """A geir TensorType from an ONNX tensor TypeProto.

    An unnamed unknown dim becomes the symbol ``f"{unknown_dim}_{k}"`` when ``unknown_dim`` is
    given, and is an error otherwise; with ``unknown_dim``, a type without a shape is of unknown rank (an error
    otherwise).
    """
    kind = "tensor"
    if tp.HasField("optional_type"):
        tp, kind = tp.optional_type.elem_type, "optional"
    if tp.HasField("sequence_type"):
        tp, kind = tp.sequence_type.elem_type, "sequence" if kind == "tensor" else "optional_sequence"
    if not tp.HasField("tensor_type"):
        raise GraphError(f"{what}: expected a tensor type (or a sequence or optional of tensors), got "
                         f"{tp.WhichOneof('value')}")
    tt = tp.tensor_type
    try:
        dtype = as_dtype(int(tt.elem_type))
    except TypeError:
        names = {v: k for k, v in TensorProto.DataType.items()}
        raise GraphError(f"{what}: element type {names.get(tt.elem_type, tt.elem_type)} ({_numpy_name(tt.elem_type)}) "
                         f"is not one of geir's dtypes") from None
    if kind != "tensor":
        return TensorType(dtype, None, kind)
    if not tt.HasField("shape"):
        if unknown_dim is not None:
            return TensorType(dtype, None)
        raise GraphError(f"{what}: expected a shape, got none")
    dims: list[int | str] = []
    for k, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param.isidentifier():
            dims.append(d.dim_param)
        elif unknown_dim is not None:
            dims.append(f"{unknown_dim}_{k}")
        else:
            raise GraphError(f"{what} dim {k}: expected a size or a symbol name, got an unnamed unknown dim")
    return TensorType(dtype, dims)


def _numpy_name(elem_type: int) -> str:
    try:
        return str(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        return "unknown to onnx"


def attribute_to_onnx(name: str, kind: str, value: Any) -> AttributeProto:
    """A geir attribute (GE kind) as an AttributeProto; Bool is an INT 0/1 (ONNX has no bool)."""
    if kind == "Bool":
        value = int(value)
    return helper.make_attribute(name, list(value) if kind == "ListInt" else value, attr_type=_KIND_TO_ONNX[kind])


def attribute_from_onnx(attr: AttributeProto, kind: str | None) -> Any:
    """The Python value of an AttributeProto; with a GE kind, INT becomes bool for Bool attributes."""
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        value = value.decode()
    if kind == "Bool" and attr.type == AttributeProto.INT:
        return bool(value)
    if kind == "ListInt" and attr.type == AttributeProto.INTS:
        return tuple(value)
    return value
