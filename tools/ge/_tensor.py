"""GE's tensor vocabulary: status codes, formats, data types, ``Shape``, ``TensorDesc``, ``Tensor``.

Names and numeric values are GE's (``ge_error_codes.h``, ``types.h``), so code ported from C++ reads
the same. geir runs the data types its ops take; the others exist (a desc may name them) and are
refused, naming the op, when a graph uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...ir._dtypes import DType
from ...ir._errors import GraphError

__all__ = [
    "DT_BF16", "DT_BOOL", "DT_DOUBLE", "DT_FLOAT", "DT_FLOAT16", "DT_INT16", "DT_INT32", "DT_INT64", "DT_INT8",
    "DT_UINT16", "DT_UINT32", "DT_UINT64", "DT_UINT8", "FAILED", "FORMAT_NCHW", "FORMAT_ND", "FORMAT_NHWC",
    "SUCCESS", "UNKNOWN_DIM", "Shape", "Tensor", "TensorDesc", "geir_dtype", "ge_data_type",
]

SUCCESS = 0
FAILED = 0xFFFFFFFF
"""GE's ``ge::SUCCESS`` and ``ge::FAILED`` (a uint32 Status)."""

FORMAT_NCHW, FORMAT_NHWC, FORMAT_ND = 0, 1, 2
DT_FLOAT, DT_FLOAT16, DT_INT8, DT_INT32, DT_UINT8 = 0, 1, 2, 3, 4
DT_INT16, DT_UINT16, DT_UINT32, DT_INT64, DT_UINT64, DT_DOUBLE, DT_BOOL = 6, 7, 8, 9, 10, 11, 12
DT_BF16 = 27
UNKNOWN_DIM = -1
"""A dim of -1 in a Data desc is dynamic: the graph takes any size there (a symbolic dim)."""

_TO_GEIR = {DT_FLOAT: DType.FLOAT32, DT_FLOAT16: DType.FLOAT16, DT_BF16: DType.BFLOAT16, DT_INT32: DType.INT32,
            DT_INT64: DType.INT64, DT_BOOL: DType.BOOL}
_FROM_GEIR = {v: k for k, v in _TO_GEIR.items()}
_NAMES = {value: name for name, value in globals().items() if name.startswith("DT_")}
_FORMATS = {FORMAT_NCHW: "FORMAT_NCHW", FORMAT_NHWC: "FORMAT_NHWC", FORMAT_ND: "FORMAT_ND"}


def geir_dtype(data_type: int, subject: str) -> DType:
    """The geir dtype of a GE data type; GraphError naming ``subject`` for one geir does not run."""
    try:
        return _TO_GEIR[data_type]
    except KeyError:
        name = _NAMES.get(data_type, f"data type {data_type!r}")
        supported = ", ".join(_NAMES[k] for k in _TO_GEIR)
        raise GraphError(f"{subject}: data type: expected one of {supported}, got {name}") from None


def ge_data_type(dtype: DType) -> int:
    return _FROM_GEIR[dtype]


class Shape:
    """``ge::Shape``: a list of dims (-1 for a dynamic one)."""

    def __init__(self, dims: Sequence[int] = ()) -> None:
        dims = list(dims)
        for k, d in enumerate(dims):
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < UNKNOWN_DIM:
                raise GraphError(f"ge.Shape: dim {k}: expected an int >= 0 or -1 (dynamic), got {d!r}")
        self._dims = [int(d) for d in dims]

    def GetDims(self) -> list[int]:
        return list(self._dims)

    def GetDimNum(self) -> int:
        return len(self._dims)

    def GetDim(self, index: int) -> int:
        return self._dims[index]

    def GetShapeSize(self) -> int:
        """The element count; -1 while a dim is dynamic (as GE)."""
        return -1 if UNKNOWN_DIM in self._dims else int(np.prod(self._dims, dtype=np.int64))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shape) and other._dims == self._dims

    def __repr__(self) -> str:
        return f"Shape({self._dims})"


class TensorDesc:
    """``ge::TensorDesc``: shape, format and data type of a tensor."""

    def __init__(self, shape: Shape | None = None, format: int = FORMAT_ND, dtype: int = DT_FLOAT) -> None:
        if shape is not None and not isinstance(shape, Shape):
            raise GraphError(f"ge.TensorDesc: shape: expected a ge.Shape, got {type(shape).__name__}")
        if format not in _FORMATS:
            raise GraphError(f"ge.TensorDesc: format: expected one of {', '.join(_FORMATS.values())}, got {format!r}")
        if dtype not in _NAMES:
            raise GraphError(f"ge.TensorDesc: data type: expected a ge.DT_* value, got {dtype!r}")
        self._shape = shape if shape is not None else Shape()
        self._format = format
        self._dtype = dtype
        self._placement: Any = None
        self._real_dim_cnt = self._shape.GetDimNum()

    def GetShape(self) -> Shape:
        return self._shape

    def SetShape(self, shape: Shape) -> None:
        self._shape = shape

    def GetDataType(self) -> int:
        return self._dtype

    def SetDataType(self, dtype: int) -> None:
        self._dtype = dtype

    def GetFormat(self) -> int:
        return self._format

    def SetFormat(self, format: int) -> None:
        self._format = format

    def SetPlacement(self, placement: Any) -> None:
        """Kept for ported code; geir has one memory (the host)."""
        self._placement = placement

    def SetRealDimCnt(self, count: int) -> None:
        self._real_dim_cnt = count

    def GetRealDimCnt(self) -> int:
        return self._real_dim_cnt

    def data_type_name(self) -> str:
        return _NAMES[self._dtype]

    def __repr__(self) -> str:
        return f"TensorDesc({self._shape}, {_FORMATS[self._format]}, {self.data_type_name()})"


class Tensor:
    """``ge::Tensor``: a desc and its data, a NumPy array of exactly the desc's dtype and shape."""

    def __init__(self, desc: TensorDesc | None = None, data: Any = None) -> None:
        self._desc = desc if desc is not None else TensorDesc()
        self._data: np.ndarray | None = None
        if data is not None:
            self.SetData(data)

    def SetData(self, data: Any) -> None:
        """Take ``data`` (copied, so later edits of the caller's array do not leak in)."""
        dtype = geir_dtype(self._desc.GetDataType(), "ge.Tensor")
        array = np.asarray(data)
        if array.dtype != dtype.numpy:
            raise GraphError(f"ge.Tensor: data: expected {dtype.value} ({self._desc.data_type_name()} in the desc), "
                             f"got {array.dtype}")
        dims = self._desc.GetShape().GetDims()
        if len(dims) != array.ndim or any(d not in (UNKNOWN_DIM, a) for d, a in zip(dims, array.shape)):
            raise GraphError(f"ge.Tensor: data: expected shape {dims} (the desc's), got {list(array.shape)}")
        self._data = np.array(array, copy=True)

    def GetData(self) -> np.ndarray | None:
        return self._data

    def GetTensorDesc(self) -> TensorDesc:
        return self._desc

    def SetTensorDesc(self, desc: TensorDesc) -> None:
        self._desc = desc

    def GetSize(self) -> int:
        return 0 if self._data is None else self._data.nbytes

    def __repr__(self) -> str:
        return f"Tensor({self._desc})"
