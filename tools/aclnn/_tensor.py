"""``aclTensor`` and ``aclIntArray``: views of the caller's memory, described the way aclnn describes them.

``aclCreateTensor(array, shape=..., strides=..., offset=...)`` is C's ``aclCreateTensor(viewDims, dataType, stride,
offset, format, storageDims, tensorData)`` over a NumPy array (or a CPU torch tensor) as the storage: the view
reads and writes the caller's memory, so an in-place op writes through it. Shapes, strides and the offset are in
elements; the data type is the array's (a type geir's ops do not take still makes a tensor, which the op refuses
with ``ACLNN_ERR_PARAM_INVALID`` as CANN does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ...ir._dtypes import DType
from ...ir._errors import GraphError

__all__ = [
    "ACL_BF16", "ACL_BOOL", "ACL_DOUBLE", "ACL_FLOAT", "ACL_FLOAT16", "ACL_FORMAT_FRACTAL_NZ", "ACL_FORMAT_NC1HWC0",
    "ACL_FORMAT_NCHW", "ACL_FORMAT_ND", "ACL_FORMAT_NHWC", "ACL_INT16", "ACL_INT32", "ACL_INT64", "ACL_INT8",
    "ACL_UINT16", "ACL_UINT32", "ACL_UINT64", "ACL_UINT8", "aclCreateIntArray", "aclCreateTensor",
    "aclDestroyIntArray", "aclDestroyTensor", "aclGetDataType", "aclGetFormat", "aclGetViewOffset",
    "aclGetViewShape", "aclGetViewStrides", "aclIntArray", "aclTensor",
]

ACL_FLOAT, ACL_FLOAT16, ACL_INT8, ACL_INT32, ACL_UINT8 = 0, 1, 2, 3, 4
ACL_INT16, ACL_UINT16, ACL_UINT32, ACL_INT64, ACL_UINT64, ACL_DOUBLE, ACL_BOOL = 6, 7, 8, 9, 10, 11, 12
ACL_BF16 = 27
"""``aclDataType`` values (``acl_base.h``)."""
ACL_FORMAT_NCHW, ACL_FORMAT_NHWC, ACL_FORMAT_ND, ACL_FORMAT_NC1HWC0, ACL_FORMAT_FRACTAL_NZ = 0, 1, 2, 3, 29
"""``aclFormat`` values; the ops here take ND."""

_ACL_OF_NUMPY = {np.dtype(np.float32): ACL_FLOAT, np.dtype(np.float16): ACL_FLOAT16, np.dtype(np.int8): ACL_INT8,
                 np.dtype(np.int32): ACL_INT32, np.dtype(np.uint8): ACL_UINT8, np.dtype(np.int16): ACL_INT16,
                 np.dtype(np.uint16): ACL_UINT16, np.dtype(np.uint32): ACL_UINT32, np.dtype(np.int64): ACL_INT64,
                 np.dtype(np.uint64): ACL_UINT64, np.dtype(np.float64): ACL_DOUBLE, np.dtype(np.bool_): ACL_BOOL,
                 np.dtype(ml_dtypes.bfloat16): ACL_BF16}
_NAME_OF_ACL = {value: name for name, value in globals().items() if name.startswith("ACL_") and "FORMAT" not in name}
_FORMAT_NAMES = {ACL_FORMAT_NCHW: "ACL_FORMAT_NCHW", ACL_FORMAT_NHWC: "ACL_FORMAT_NHWC", ACL_FORMAT_ND: "ACL_FORMAT_ND",
                 ACL_FORMAT_NC1HWC0: "ACL_FORMAT_NC1HWC0", ACL_FORMAT_FRACTAL_NZ: "ACL_FORMAT_FRACTAL_NZ"}
_GEIR_OF_ACL = {ACL_FLOAT: DType.FLOAT32, ACL_FLOAT16: DType.FLOAT16, ACL_BF16: DType.BFLOAT16,
                ACL_INT32: DType.INT32, ACL_INT64: DType.INT64, ACL_BOOL: DType.BOOL, ACL_INT8: DType.INT8}


def data_type_name(data_type: int) -> str:
    return _NAME_OF_ACL.get(data_type, f"aclDataType {data_type}")


def format_name(fmt: int) -> str:
    return _FORMAT_NAMES.get(fmt, f"aclFormat {fmt}")


class aclTensor:  # noqa: N801  (CANN's name)
    """A strided view of caller memory with aclnn's descriptors (create it with ``aclCreateTensor``)."""

    __slots__ = ("view", "data_type", "format", "offset", "strides", "destroyed")

    def __init__(self, view: np.ndarray, data_type: int, fmt: int, offset: int, strides: tuple[int, ...]) -> None:
        self.view = view
        self.data_type = data_type
        self.format = fmt
        self.offset = offset
        self.strides = strides
        self.destroyed = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.view.shape)

    @property
    def dtype(self) -> DType | None:
        """The geir dtype, or None for a data type no geir op takes."""
        return _GEIR_OF_ACL.get(self.data_type)

    def is_contiguous(self) -> bool:
        """Row-major with no gaps (dims of size 1 may have any stride; an empty tensor is contiguous), as aclnn's
        ``IsContiguous``."""
        if self.is_empty():
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def is_empty(self) -> bool:
        return 0 in self.shape

    def read(self) -> np.ndarray:
        """The view's elements as a C-contiguous array (a copy only where the view is strided)."""
        return np.ascontiguousarray(self.view)

    def __repr__(self) -> str:
        return (f"aclTensor(shape={list(self.shape)}, strides={list(self.strides)}, offset={self.offset}, "
                f"{data_type_name(self.data_type)}, {format_name(self.format)})")


class aclIntArray:  # noqa: N801  (CANN's name)
    """An int64 array argument (``aclCreateIntArray``)."""

    __slots__ = ("values", "destroyed")

    def __init__(self, values: Sequence[int]) -> None:
        self.values = tuple(values)
        self.destroyed = False

    def __repr__(self) -> str:
        return f"aclIntArray({list(self.values)})"


def _as_numpy(array: Any) -> np.ndarray:
    """A NumPy array sharing ``array``'s memory: a NumPy array itself, or a CPU torch tensor."""
    if isinstance(array, np.ndarray):
        return array
    module = type(array).__module__
    if module.startswith("torch"):
        import torch

        if array.device.type != "cpu":
            raise GraphError(f"aclCreateTensor: array: expected host memory (a CPU tensor), got a tensor on "
                             f"{array.device}; geir runs on the host")
        if array.dtype == torch.bfloat16:
            return np.asarray(array.detach().view(torch.int16).numpy()).view(ml_dtypes.bfloat16)
        return np.asarray(array.detach().numpy())
    raise GraphError(f"aclCreateTensor: array: expected a numpy.ndarray or a CPU torch.Tensor, got "
                     f"{type(array).__name__}")


def _ints(values: Sequence[int] | None, what: str) -> tuple[int, ...] | None:
    if values is None:
        return None
    out = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise GraphError(f"aclCreateTensor: {what}[{k}]: expected an int, got {v!r}")
        out.append(int(v))
    return tuple(out)


def aclCreateTensor(array: Any, *, shape: Sequence[int] | None = None, strides: Sequence[int] | None = None,
                    offset: int = 0, format: int = ACL_FORMAT_ND) -> aclTensor:  # noqa: A002  (CANN's name)
    """A tensor viewing ``array``'s memory; ``shape``/``strides``/``offset`` (elements) describe a strided view.

    Without them the view is ``array`` itself with its own strides. With them, ``array`` is the storage: it must be
    C-contiguous and the view must lie inside it (a GraphError names the dim that reaches past the end).
    """
    base = _as_numpy(array)
    data_type = _ACL_OF_NUMPY.get(base.dtype, -1)
    if data_type == -1:
        raise GraphError(f"aclCreateTensor: array: data type {base.dtype} has no aclDataType")
    if isinstance(format, bool) or not isinstance(format, int):
        raise GraphError(f"aclCreateTensor: format: expected an aclFormat int, got {format!r}")
    item = base.itemsize
    view_shape, view_strides = _ints(shape, "shape"), _ints(strides, "strides")
    if view_shape is None and view_strides is None and offset == 0:
        if any(s % item for s in base.strides) or any(s < 0 for s in base.strides):
            raise GraphError(f"aclCreateTensor: array: strides {base.strides} (bytes) are not non-negative "
                             f"multiples of the element size {item}")
        return aclTensor(base, data_type, format, 0, tuple(s // item for s in base.strides))
    if not base.flags.c_contiguous:
        raise GraphError("aclCreateTensor: array: the storage of a view given by shape/strides/offset must be "
                         "C-contiguous; pass the contiguous base array")
    storage = base.reshape(-1)
    view_shape = view_shape if view_shape is not None else tuple(base.shape)
    if view_strides is None:
        view_strides = tuple(int(np.prod(view_shape[k + 1:], dtype=np.int64)) for k in range(len(view_shape)))
    if len(view_strides) != len(view_shape):
        raise GraphError(f"aclCreateTensor: strides: expected {len(view_shape)} values (one per dim of shape "
                         f"{list(view_shape)}), got {len(view_strides)}")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise GraphError(f"aclCreateTensor: offset: expected an int >= 0, got {offset!r}")
    for k, (size, stride) in enumerate(zip(view_shape, view_strides)):
        if size < 0 or stride < 0:
            raise GraphError(f"aclCreateTensor: dim {k}: expected size >= 0 and stride >= 0, got size {size}, "
                             f"stride {stride}")
    if 0 not in view_shape:
        last = int(offset) + sum((size - 1) * stride for size, stride in zip(view_shape, view_strides))
        if last >= storage.size:
            raise GraphError(f"aclCreateTensor: the view (shape {list(view_shape)}, strides {list(view_strides)}, "
                             f"offset {offset}) reaches element {last}, past the storage's {storage.size} elements")
    try:
        view = np.lib.stride_tricks.as_strided(storage[int(offset):] if storage.size else storage, view_shape,
                                               tuple(s * item for s in view_strides), writeable=base.flags.writeable)
    except (ValueError, OverflowError) as exc:       # a stride past what NumPy can address (of a size-1 dim, say)
        raise GraphError(f"aclCreateTensor: the view (shape {list(view_shape)}, strides {list(view_strides)}, "
                         f"offset {offset}) cannot be addressed: {exc}") from None
    return aclTensor(view, data_type, format, int(offset), view_strides)


def aclCreateIntArray(values: Sequence[int]) -> aclIntArray:
    """An int64 array argument (a ``partialSlice``, a ``restoreShape``)."""
    checked = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not -2**63 <= int(v) < 2**63:
            raise GraphError(f"aclCreateIntArray: values[{k}]: expected an int64, got {v!r}")
        checked.append(int(v))
    return aclIntArray(checked)


def aclDestroyTensor(tensor: aclTensor | None) -> int:
    """Release a tensor (its memory stays the caller's); a destroyed tensor is refused by every later call."""
    if tensor is not None:
        tensor.destroyed = True
    return 0


def aclDestroyIntArray(array: aclIntArray | None) -> int:
    if array is not None:
        array.destroyed = True
    return 0


def aclGetViewShape(tensor: aclTensor) -> tuple[int, list[int]]:
    return 0, list(tensor.shape)


def aclGetViewStrides(tensor: aclTensor) -> tuple[int, list[int]]:
    return 0, list(tensor.strides)


def aclGetViewOffset(tensor: aclTensor) -> tuple[int, int]:
    return 0, tensor.offset


def aclGetDataType(tensor: aclTensor) -> tuple[int, int]:
    return 0, tensor.data_type


def aclGetFormat(tensor: aclTensor) -> tuple[int, int]:
    return 0, tensor.format
