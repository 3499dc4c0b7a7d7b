"""The moe family (MoeTokenUnpermute and its gradient): everything about it that is not a runtime kernel.

``schema``: the declarations and their rules; ``body``: the ONNX function bodies; ``targets``: the
device restrictions; ``examples``: the spec's worked examples as data and the random cases (``MoeCase``) the
benchmarks measure.
"""

from __future__ import annotations

from . import body, examples, fusion, fusion_loop, targets, vjp  # noqa: F401  (each registers its part of the family)
from .schema import FORWARD, GRAD

__all__ = ["FORWARD", "GRAD"]
