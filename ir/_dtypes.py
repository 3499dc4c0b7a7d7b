"""Tensor element types: the six geir dtypes and their NumPy and ONNX encodings."""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np
from onnx import TensorProto

__all__ = ["DType", "DTypeLike", "as_dtype"]


class DType(enum.Enum):
    """An element type of a geir tensor.

    The value is the canonical name, so ``DType("float16") is DType.FLOAT16``.
    """

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT32 = "int32"
    INT64 = "int64"
    BOOL = "bool"

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype (bfloat16 is ``ml_dtypes.bfloat16``)."""
        return _NUMPY[self]

    @property
    def onnx(self) -> int:
        """The ``onnx.TensorProto`` element type code."""
        return _ONNX[self]

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_floating(self) -> bool:
        return self in (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"geir.{self.name.lower()}"


DTypeLike = DType | str | np.dtype | type

_NUMPY: dict[DType, np.dtype] = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.BOOL: np.dtype(np.bool_),
}
_ONNX: dict[DType, int] = {
    DType.FLOAT32: TensorProto.FLOAT,
    DType.FLOAT16: TensorProto.FLOAT16,
    DType.BFLOAT16: TensorProto.BFLOAT16,
    DType.INT32: TensorProto.INT32,
    DType.INT64: TensorProto.INT64,
    DType.BOOL: TensorProto.BOOL,
}
_FROM_NUMPY: dict[np.dtype, DType] = {v: k for k, v in _NUMPY.items()}
_FROM_ONNX: dict[int, DType] = {v: k for k, v in _ONNX.items()}


def as_dtype(value: Any) -> DType:
    """Convert a dtype given as a geir dtype, a name, a NumPy dtype/type or an ONNX code.

    Raises:
        TypeError: ``value`` names no geir dtype; the message lists the accepted names.
    """
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        try:
            return DType(value)
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        if value in _FROM_ONNX:
            return _FROM_ONNX[value]
    else:
        try:
            found = _FROM_NUMPY.get(np.dtype(value))
        except TypeError:
            found = None
        if found is not None:
            return found
    names = ", ".join(d.value for d in DType)
    raise TypeError(f"unsupported dtype {value!r}; expected one of: {names}")
