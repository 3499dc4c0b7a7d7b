"""ONNX Slice's one meaning, for every place geir computes it (the NumPy runtime, the float64 reference, the VJP).

ONNX (opset 13 on) adds the dim to a negative start or end, then clamps: with a positive step, start and end to
[0, dim]; with a negative step, start to [0, dim - 1] and end to [-1, dim - 1], where -1 means "past index 0".
INT64's min and max are ordinary values under these rules (the sentinels for "to either end"). Python's slices
differ: a start below -dim with a negative step selects nothing there, where ONNX starts at index 0, and an end
of -1 there means the last element. So nothing here uses Python's slice rules on raw starts and ends: the bounds
are computed once, as a ``range`` of the positions read, in the order read.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SliceError", "slice_index", "slice_positions", "slice_range"]


class SliceError(ValueError):
    """Operands of a Slice that ONNX does not define (callers add the node and raise their own error kind)."""


def slice_range(dim: int, start: int, end: int, step: int) -> range:
    """The positions along an axis of size ``dim`` that ONNX's Slice reads, in the order it reads them."""
    dim, start, end, step = int(dim), int(start), int(end), int(step)
    if step == 0:
        raise SliceError("steps: expected a non-zero step, got 0")
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return range(start, end, step) if dim > 0 else range(0)


def _ints(values: Sequence[int] | None, name: str, count: int | None) -> list[int] | None:
    if values is None:
        return None
    out = [int(v) for v in values]
    if count is not None and len(out) != count:
        raise SliceError(f"{name}: expected {count} values (one per entry of starts), got {len(out)}")
    return out


def slice_positions(shape: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                    axes: Sequence[int] | None = None, steps: Sequence[int] | None = None) -> dict[int, range]:
    """Per sliced axis (normalised to [0, rank)), the positions ONNX's Slice reads there; other axes are whole.

    Raises:
        SliceError: lengths of starts, ends, axes and steps differ, an axis is out of range or repeated, a step is 0.
    """
    rank = len(shape)
    begin = _ints(starts, "starts", None) or []
    stop = _ints(ends, "ends", len(begin)) or []
    axis_list = _ints(axes, "axes", len(begin))
    step_list = _ints(steps, "steps", len(begin))
    axis_list = list(range(len(begin))) if axis_list is None else axis_list
    step_list = [1] * len(begin) if step_list is None else step_list
    chosen: dict[int, range] = {}
    for i, (s, e, a, k) in enumerate(zip(begin, stop, axis_list, step_list)):
        if not -rank <= a < rank:
            raise SliceError(f"axes[{i}]: expected an axis in [{-rank}, {rank - 1}], got {a}")
        axis = a % rank
        if axis in chosen:
            raise SliceError(f"axes[{i}]: expected distinct axes, got axis {axis} twice")
        try:
            chosen[axis] = slice_range(shape[axis], s, e, k)
        except SliceError as exc:
            raise SliceError(f"{exc} (axis {axis}, entry {i})") from None
    return chosen


def slice_index(shape: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                axes: Sequence[int] | None = None, steps: Sequence[int] | None = None) -> tuple[slice, ...]:
    """A NumPy basic index (a view) selecting what ONNX's Slice selects from an array of ``shape``."""
    index = [slice(None)] * len(shape)
    for axis, positions in slice_positions(shape, starts, ends, axes, steps).items():
        if len(positions) == 0:
            index[axis] = slice(0, 0)
        else:   # a non-empty range: its first and last positions are valid indices
            last = positions[-1]
            stop = last + (1 if positions.step > 0 else -1)
            index[axis] = slice(positions.start, None if stop < 0 else stop, positions.step)
    return tuple(index)
