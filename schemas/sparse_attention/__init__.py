"""The sparse attention family (SparseFlashAttention and its gradient):
everything about it that is not a runtime kernel.

``schema``: the declarations and their rules; ``body``: the ONNX function bodies; ``targets``: the
device restrictions; ``examples``: the spec's worked example as data and ``SfaCase``, the random valid cases
``geir bench`` and ``geir example`` draw; ``selection``: which keys a query row sees, the one statement the rules,
the kernels and the validation share (the ONNX body is tested against it); ``paging``: where each
logical key of a paged KV cache lives (PA_BSND, spec 4.11).
"""

from __future__ import annotations

from . import body, examples, fusion, fusion_top_k, targets, vjp  # noqa: F401  (each registers its part of the family)
from .schema import FORWARD, GRAD, INT64_MAX, PAGED, is_paged, role_sizes

__all__ = ["FORWARD", "GRAD", "INT64_MAX", "PAGED", "is_paged", "role_sizes"]
