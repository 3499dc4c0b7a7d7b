"""Torch in, torch out: ``geir.torch.run`` runs any graph on torch tensors and returns torch tensors, and
``geir.torch.to_torch`` turns what ``geir.run`` returns (NumPy arrays) into torch tensors.

NumPy has no bfloat16 or float8 of its own (geir's results hold ``ml_dtypes`` types) and ``torch.from_numpy`` refuses
them; their bits go through a same-size integer view and come back as torch's dtype of the same name
(``_bridge.to_torch`` for bfloat16, the converter the ops themselves use). No copy is made where the tensor can share
the array's memory: a writeable array whose strides are non-negative multiples of its itemsize (every result both
runtimes allocate). A read-only array (a broadcast view, a constant) or one with negative strides is copied, so a
tensor is never a writeable window on memory its array does not let be written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import ml_dtypes
import numpy as np
import torch

from ...ir._errors import ExecutionError
from ..facade import GraphLike
from ..facade import run as _run
from ._bridge import to_numpy as _to_numpy
from ._bridge import to_torch as _shared_tensor

__all__ = ["run", "to_torch"]

_BITS: dict[np.dtype, torch.dtype] = {
    np.dtype(getattr(ml_dtypes, name)): getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(ml_dtypes, name) and hasattr(torch, name)}
"""The one-byte float kinds NumPy holds as ``ml_dtypes`` types and torch has under the same name: viewed as uint8."""
_NATIVE = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                          np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                                          np.complex128)) | {np.dtype(ml_dtypes.bfloat16)}
"""What ``_bridge.to_torch`` converts (``torch.from_numpy``'s dtypes, and bfloat16 through an int16 view)."""
_SUB_BYTE = ("int4", "uint4", "int2", "uint2", "float4", "float6")


def _shares(array: np.ndarray) -> bool:
    """Whether a tensor may share ``array``'s memory: writeable, strides non-negative multiples of the itemsize."""
    size = array.itemsize
    return bool(array.flags.writeable) and all(s >= 0 and s % size == 0 for s in array.strides)


def _tensor(array: object, where: str) -> torch.Tensor:
    if type(array) is np.ndarray and array.flags.c_contiguous and array.flags.writeable and array.dtype in _NATIVE:
        return _shared_tensor(array)            # every result a runtime allocates, checked in a few lookups
    if not isinstance(array, np.ndarray):
        raise TypeError(f"geir.torch.to_torch: {where}: expected a NumPy array, got {type(array).__name__}")
    native = array.dtype.newbyteorder("=")
    if native not in _NATIVE and native not in _BITS:
        raise TypeError(f"geir.torch.to_torch: {where}: torch has no dtype for {array.dtype} values"
                        + (" (torch's sub-byte dtypes are packed; geir holds one value a byte)"
                           if array.dtype.name.startswith(_SUB_BYTE) else "")
                        + "; convert the array with numpy first (e.g. .astype(np.float32))")
    if native != array.dtype:
        array = array.astype(native)            # another byte order: exact, into a fresh C-contiguous copy
    elif not _shares(array):
        array = np.array(array, order="C")      # a fresh, writeable, C-contiguous copy
    bits = _BITS.get(array.dtype)
    if bits is not None:
        return torch.from_numpy(array.view(np.uint8)).view(bits)
    return _shared_tensor(array)


def _value(value: object, where: str) -> Any:
    """One result of ``geir.run``: an array, a list of arrays (a sequence output) or None (an absent optional)."""
    if value is None:
        return None
    if isinstance(value, list):
        return [_tensor(item, f"{where} item {k}") for k, item in enumerate(value)]
    return _tensor(value, where)


@overload
def to_torch(results: np.ndarray) -> torch.Tensor: ...


@overload
def to_torch(results: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]: ...


@overload
def to_torch(results: tuple[np.ndarray, ...]) -> tuple[torch.Tensor, ...]: ...


@overload
def to_torch(results: list[np.ndarray]) -> list[torch.Tensor]: ...


def to_torch(results: np.ndarray | Mapping[str, np.ndarray] | tuple[np.ndarray, ...] | list[np.ndarray]
             ) -> torch.Tensor | dict[str, torch.Tensor] | tuple[torch.Tensor, ...] | list[torch.Tensor]:
    """NumPy results as CPU torch tensors: an array, ``geir.run``'s dict (by output name), a tuple or a list.

    Each tensor has the array's shape and values bit for bit, in torch's dtype of the same name (bfloat16 and the
    float8 kinds included), and shares the array's memory (no copy) when the array is writeable with non-negative
    strides; otherwise it is a copy. In a dict, a list of arrays (a sequence output) becomes a list of tensors and
    None (an absent optional output) stays None.

    Raises:
        TypeError: not an array, or a dtype torch has no equivalent of (strings; int4, uint4, int2, uint2, float4
            and float6, which torch holds packed), naming the dtype and the output.
    """
    if isinstance(results, np.ndarray):
        return _tensor(results, "array")
    if isinstance(results, Mapping):
        return {name: _value(value, f"output '{name}'") for name, value in results.items()}
    if isinstance(results, tuple):
        return tuple(_tensor(a, f"item {k}") for k, a in enumerate(results))
    if isinstance(results, list):
        return [_tensor(a, f"item {k}") for k, a in enumerate(results)]
    raise TypeError(f"geir.torch.to_torch: expected a NumPy array, or a dict, tuple or list of them (what geir.run "
                    f"returns), got {type(results).__name__}")


def _refuse_off_cpu(feed: object, where: str) -> None:
    """As every ``geir.torch`` function: a tensor on another device is an ExecutionError (no silent copy)."""
    items = feed if isinstance(feed, (list, tuple)) else (feed,)
    for item in items:
        if isinstance(item, torch.Tensor) and not item.is_cpu and not item.is_meta:
            raise ExecutionError(f"geir.torch.run: {where} is a {item.device.type} tensor ({item.device}): geir "
                                 "computes on the CPU only (no GPU path yet); move it with .cpu()")


def run(graph: GraphLike, feeds: Mapping[str, torch.Tensor | np.ndarray], runtime: str = "numpy",
        outputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``geir.run`` with torch tensors in and out: the outputs by name as CPU torch tensors.

    Feeds and ``runtime`` are as for ``geir.run`` (CPU tensors of the inputs' dtypes, bfloat16 and ones that
    require grad included, or NumPy arrays); the values are ``geir.run``'s bit for bit, each tensor holding the
    memory the runtime allocated for it (no copy; ``to_torch``), never a feed's memory. ``outputs`` gives
    caller-provided tensors by output name (CPU, contiguous, of the output's dtype and shape, not requiring grad):
    the run writes them and returns those very tensors. The results record no autograd history (the ``geir.torch``
    ops do, and ``geir.grad`` differentiates a graph).

    Raises:
        ExecutionError: a feed or output tensor on another device than the CPU (as every ``geir.torch`` function;
            move it with ``.cpu()``), an output tensor that requires grad, or anything ``geir.run`` refuses.
        TypeError: an output of a dtype torch has none of (``to_torch``).
    """
    if not isinstance(feeds, Mapping):
        raise ExecutionError(f"geir.torch.run: feeds: expected a mapping of input name -> tensor (a dict), got "
                             f"{type(feeds).__name__}")
    for name, feed in feeds.items():
        _refuse_off_cpu(feed, f"feed '{name}'")
    buffers: dict[str, np.ndarray] | None = None
    if outputs is not None:
        if not isinstance(outputs, Mapping):
            raise ExecutionError(f"geir.torch.run: outputs: expected a mapping of output name -> tensor, got "
                                 f"{type(outputs).__name__}")
        buffers = {}
        for name, tensor in outputs.items():
            where = f"output tensor '{name}'"
            if not isinstance(tensor, torch.Tensor):
                raise ExecutionError(f"geir.torch.run: {where}: expected a torch tensor, got {type(tensor).__name__}")
            _refuse_off_cpu(tensor, where)
            if tensor.is_conj() or tensor.is_neg():
                raise ExecutionError(f"geir.torch.run: {where} is a conjugate or negative view: the run cannot write "
                                     "the values it stands for; pass a plain tensor")
            if tensor.requires_grad:
                raise ExecutionError(f"geir.torch.run: {where} requires grad: the run writes it outside autograd; "
                                     "pass a tensor that does not (torch.empty(...), or .detach() to mean it)")
            buffers[name] = _to_numpy(tensor, where)
    results = _run(graph, feeds, runtime, buffers)  # type: ignore[arg-type]  # geir.run reads tensors too
    given = outputs or {}
    return {name: given[name] if name in given else _value(value, f"output '{name}'")
            for name, value in results.items()}
