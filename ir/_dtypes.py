"""Tensor element types: every ONNX element type geir holds, with its NumPy and ONNX encodings."""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np
from onnx import TensorProto
from onnx import __version__ as onnx_version

__all__ = ["DType", "DTypeLike", "as_dtype"]


class DType(enum.Enum):
    """An element type of a geir tensor: every ONNX tensor element type NumPy (with ``ml_dtypes``) can hold.

    The value is the canonical name, NumPy's (``DType("float16") is DType.FLOAT16``); ``string`` is NumPy's
    object dtype holding ``str``. Our ops take CANN's dtypes (their schemas list them); standard ONNX ops any.
    """

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT32 = "int32"
    INT64 = "int64"
    BOOL = "bool"
    FLOAT64 = "float64"
    INT8 = "int8"
    INT16 = "int16"
    UINT8 = "uint8"
    UINT16 = "uint16"
    UINT32 = "uint32"
    UINT64 = "uint64"
    STRING = "string"
    COMPLEX64 = "complex64"
    COMPLEX128 = "complex128"
    FLOAT8E4M3FN = "float8_e4m3fn"
    FLOAT8E4M3FNUZ = "float8_e4m3fnuz"
    FLOAT8E5M2 = "float8_e5m2"
    FLOAT8E5M2FNUZ = "float8_e5m2fnuz"
    FLOAT8E8M0 = "float8_e8m0fnu"
    FLOAT4E2M1 = "float4_e2m1fn"
    INT4 = "int4"
    UINT4 = "uint4"
    INT2 = "int2"
    UINT2 = "uint2"
    FLOAT6E2M3 = "float6_e2m3fn"
    FLOAT6E3M2 = "float6_e3m2fn"

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype (bfloat16, float8, int4 and the other narrow types are ``ml_dtypes``'; string is
        ``object``). TypeError for a narrow type the installed ml_dtypes lacks."""
        try:
            return _NUMPY[self]
        except KeyError:
            raise TypeError(f"ml_dtypes {ml_dtypes.__version__} has no {self.value} type") from None

    @property
    def onnx(self) -> int:
        """The ``onnx.TensorProto`` element type code. TypeError for a type the installed onnx does not know."""
        try:
            return _ONNX[self]
        except KeyError:
            raise TypeError(f"onnx {onnx_version} has no element type {self.value}") from None

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_floating(self) -> bool:
        """Real floating point (float64 down to the float4/6/8 formats): what autodiff differentiates."""
        return self in _FLOATING

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"geir.{self.name.lower()}"


DTypeLike = DType | str | np.dtype | type

_FLOATING = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64, DType.FLOAT8E4M3FN,
                       DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2, DType.FLOAT8E5M2FNUZ, DType.FLOAT8E8M0,
                       DType.FLOAT4E2M1, DType.FLOAT6E2M3, DType.FLOAT6E3M2})


def _numpy_dtype(dtype: DType) -> np.dtype | None:
    """NumPy's dtype for ``dtype``; None for a narrow type the installed ml_dtypes does not have yet."""
    if dtype is DType.STRING:
        return np.dtype(object)
    narrow = getattr(ml_dtypes, dtype.value, None)
    if narrow is not None:
        return np.dtype(narrow)
    try:
        return np.dtype(dtype.value)     # by name: NumPy 1.x has no np.bool attribute, yet dtype("bool")
    except TypeError:
        return None


_NUMPY: dict[DType, np.dtype] = {d: t for d in DType if (t := _numpy_dtype(d)) is not None}
_ONNX: dict[DType, int] = {d: getattr(TensorProto, d.name.replace("FLOAT32", "FLOAT").replace("FLOAT64", "DOUBLE"))
                           for d in DType if hasattr(TensorProto, d.name.replace("FLOAT32", "FLOAT")
                                                     .replace("FLOAT64", "DOUBLE"))}
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
    elif value is not None:    # np.dtype(None) is float64: None names no dtype
        try:
            as_numpy = np.dtype(value)
            found = DType.STRING if as_numpy.kind in "US" else _FROM_NUMPY.get(as_numpy)
        except TypeError:
            found = None
        if found is not None:
            return found
    names = ", ".join(d.value for d in DType)
    raise TypeError(f"unsupported dtype {value!r}; expected one of: {names}")
