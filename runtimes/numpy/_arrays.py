"""The NumPy backend of the array protocol (``runtimes._arrays.ArrayBackend``): plain ``numpy.ndarray`` in host
memory, bfloat16 as ``ml_dtypes.bfloat16``. Feeds may also be PyTorch tensors (converted where that is exact) or
anything ``numpy.asarray`` reads."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ...ir._dtypes import DType
from ...ir._errors import ExecutionError

__all__ = ["NUMPY", "NumpyBackend"]

_DTYPES: dict[np.dtype, DType] = {d.numpy: d for d in DType}


class NumpyBackend:
    """NumPy arrays as the runtime core sees them (one instance, ``NUMPY``)."""

    name = "numpy"
    array_type = np.ndarray
    kind = "a NumPy array"
    empty_example = "np.empty(shape, dtype)"

    may_share_memory = staticmethod(np.may_share_memory)
    """NumPy's bounds check: conservative, never a wrong False."""

    def is_array(self, obj: object) -> bool:
        return isinstance(obj, np.ndarray)

    def as_array(self, feed: object, where: str) -> np.ndarray:
        """A NumPy array of the values fed, converted where that is exact: PyTorch tensors (also bfloat16, ones
        that require grad, detached, and negative or conjugate views, resolved), arrays of non-native byte order.
        ExecutionError otherwise (a sparse, meta or other tensor without plain strided data, say)."""
        if type(feed).__module__.split(".")[0] == "torch" and hasattr(feed, "detach"):
            feed = _tensor_as_array(feed, where)
        try:
            array = np.asarray(feed)
        except Exception as exc:
            raise ExecutionError(f"{where}: cannot be read as an array ({type(feed).__name__}: {exc})") from None
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        return array

    def from_host(self, array: np.ndarray) -> np.ndarray:
        return array

    def host_view(self, array: np.ndarray, values: bool = True) -> np.ndarray:
        return array

    def dtype_of(self, array: np.ndarray) -> DType | None:
        found = _DTYPES.get(array.dtype)
        return DType.STRING if found is None and array.dtype.kind in "US" else found   # str_ arrays are strings too

    def dtype_name(self, array: np.ndarray) -> str:
        return str(array.dtype)

    def is_writeable_contiguous(self, array: np.ndarray) -> bool:
        flags = array.flags
        return bool(flags.c_contiguous and flags.writeable)

    def copy(self, array: np.ndarray) -> np.ndarray:
        return array.copy()

    def copy_into(self, buffer: np.ndarray, array: np.ndarray) -> None:
        np.copyto(buffer, array)

    def kernel_errstate(self) -> AbstractContextManager[Any]:
        return np.errstate(all="ignore")


NUMPY = NumpyBackend()


def _tensor_as_array(feed: object, where: str) -> np.ndarray:
    """A PyTorch tensor's values as a NumPy array (torch is imported lazily: it is optional for geir)."""
    import torch

    tensor = feed.detach()  # type: ignore[attr-defined]
    if tensor.layout != torch.strided:
        raise ExecutionError(f"{where}: a torch tensor of layout {tensor.layout} is not a dense array; convert it "
                             f"with .to_dense() first")
    if tensor.is_meta:
        raise ExecutionError(f"{where}: a torch tensor on the meta device has no data to run on")
    try:
        tensor = tensor.cpu().resolve_neg().resolve_conj()   # a negative or conjugate view: the values it means
        if tensor.dtype == torch.bfloat16:   # NumPy has no bfloat16: reinterpret the bits
            import ml_dtypes

            return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    except Exception as exc:   # a quantized, nested or other tensor NumPy cannot hold
        raise ExecutionError(f"{where}: cannot be read as an array (a torch tensor of dtype {tensor.dtype}: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
