"""The moe_permute family (MoeTokenPermute and its gradient): the token side of the MoE loop, whose
``sorted_indices`` are the ones MoeTokenUnpermute reads.

``schema``: the declarations and their rules (with CANN's sources); ``body``: the ONNX function bodies;
``targets``: the device restrictions; ``vjp``: each op's VJP is the other; ``fusion``: the exported torch form;
``examples``: worked examples and the random cases (``PermuteCase``) the benchmarks measure.
"""

from __future__ import annotations

from . import body, examples, fusion, targets, vjp  # noqa: F401  (each registers its part of the family)
from .schema import FORWARD, GRAD

__all__ = ["FORWARD", "GRAD"]
