"""Pool output sizes with ``ceil_mode=1`` as ONNX defines them and its engines compute them, and the export of such
a pool in a form ONNX's opset-18 shape inference gets right."""

from __future__ import annotations

from typing import Any

from ._schema import InferContext
from ._types import TensorType

__all__ = ["ceil_mode_pool_shapes", "export_attributes"]


_CEIL_MODE_POOLS = frozenset({"MaxPool", "AveragePool", "LpPool"})


def ceil_mode_pool_shapes(op_type: str, ctx: InferContext, out: tuple) -> tuple:
    """Pool output sizes with ``ceil_mode=1`` as ONNX defines them and its engines compute them.

    ONNX's rule: ``out = ceil((in + pads - ((k - 1) * d + 1)) / s) + 1``, less one when that last window would
    start past the input and its left padding (``(out - 1) * s >= in + pad_begin``). ONNX's shape inference applies
    the second half only from MaxPool-22/AveragePool-22 on (onnx 1.23 still gives MaxPool-12 and AveragePool-11/19
    the larger size), while onnx.reference and ONNX Runtime drop that window at every opset: a 2x2 input, 3x3
    kernel, stride 3 and pads 1 is ``[.., 1, 1]``, not ``[.., 2, 2]``. Applied to explicit pads (auto_pad NOTSET)
    on static spatial sizes; other cases are left as ONNX infers them.
    """
    if not out or out[0] is None or not ctx.inputs or ctx.inputs[0] is None or not ctx.inputs[0].has_rank:
        return out
    shape = tuple(ctx.inputs[0].shape)
    windows = _ceil_mode_windows(op_type, ctx.attributes, shape)
    if windows is None:
        return out
    sizes = [size for _, size, _ in windows]
    fixed = []
    for t in out:
        if t is None or t.dims is None or len(t.dims) != len(shape) or tuple(t.dims[2:]) == tuple(sizes):
            fixed.append(t)
        else:
            fixed.append(TensorType(t.dtype, tuple(t.shape[:2]) + tuple(sizes)))
    return tuple(fixed)


def _ceil_mode_windows(op_type: str, attrs: dict, shape: tuple) -> list[tuple[int, int, int]] | None:
    """Per spatial axis of a ceil_mode pool with explicit pads on static sizes: (ONNX's opset-18 inference's size,
    the true size, the end pad that gives the same windows without ceil_mode, -1 if none); None for any other
    node."""
    if op_type not in _CEIL_MODE_POOLS or not int(attrs.get("ceil_mode", 0)):
        return None
    if _text(attrs.get("auto_pad", "NOTSET")) != "NOTSET":
        return None
    kernel = [int(k) for k in attrs.get("kernel_shape", ())]
    spatial = shape[2:]
    if not kernel or len(kernel) != len(spatial) or not all(isinstance(n, int) for n in spatial):
        return None
    rank = len(kernel)
    strides = [int(v) for v in attrs.get("strides", [1] * rank)]
    dilations = [int(v) for v in attrs.get("dilations", [1] * rank)]
    pads = [int(v) for v in attrs.get("pads", [0] * (2 * rank))]
    windows = []
    for i, n in enumerate(spatial):
        extent = (kernel[i] - 1) * dilations[i] + 1
        naive = -(-(n + pads[i] + pads[i + rank] - extent) // strides[i]) + 1
        size = naive - 1 if (naive - 1) * strides[i] >= n + pads[i] else naive
        reach = (size - 1) * strides[i] + extent - n - pads[i]   # how far past the input the last window reaches
        windows.append((naive, size, max(0, reach) if reach > -strides[i] else -1))
    return windows


def export_attributes(op_type: str, attributes: dict, input_type: TensorType | None) -> dict:
    """A standard node's attributes as the export writes them at opset 18.

    A ceil_mode pool whose last window ``_ceil_mode_pool_shapes`` drops is written without ceil_mode and with the
    end pad its true windows reach: the same windows, values and size (no window reaches past that pad, so the
    count of padded elements AveragePool may divide by is the same), which ONNX's opset-18 inference then gets
    right (it would refuse the true size in the model's checker otherwise)."""
    windows = None if input_type is None or input_type.dims is None else _ceil_mode_windows(op_type, attributes,
                                                                                            input_type.dims)
    if windows is None or all(naive == size for naive, size, _ in windows):
        return attributes
    rank = len(windows)
    pads = [int(v) for v in attributes.get("pads", [0] * (2 * rank))]
    ends = [end for _, _, end in windows]
    if any(not 0 <= end <= pads[i + rank] for i, end in enumerate(ends)):
        return attributes
    return {**attributes, "ceil_mode": 0, "pads": pads[:rank] + ends}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
