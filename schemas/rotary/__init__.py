"""The rotary family (InplacePartialRotaryMul and its gradient): everything about it that is not a runtime kernel.

``schema``: the declarations and their rules; ``body``: the ONNX function bodies; ``targets``: the
device restrictions; ``negated_sin``: the grad as the forward with negated sin where a device lacks the grad;
``examples``: the spec's worked examples as data and the benchmark cases; ``rotation``: the pair tables
and the executable statement of the math that the kernels and the body are tested against.
"""

from __future__ import annotations

from . import body, examples, fusion, negated_sin, targets, vjp  # noqa: F401  (each registers its part of the family)
from .rotation import RotationTables, rotate, rotation_tables
from .schema import EMPTY_GRAD_SLICE_HINT, FORWARD, GRAD, ROTARY_MODES, rotary_slice, slice_bounds

__all__ = ["EMPTY_GRAD_SLICE_HINT", "FORWARD", "GRAD", "ROTARY_MODES", "RotationTables", "rotary_slice", "rotate",
           "rotation_tables", "slice_bounds"]
