"""The NumPy kernel table: op type -> kernel function (plain arrays and attributes in, arrays out)."""

from __future__ import annotations

from collections.abc import Callable

from .moe import moe_token_unpermute, moe_token_unpermute_grad
from .rotary import rotary_mul, rotary_mul_grad
from .sparse_attention import sparse_flash_attention, sparse_flash_attention_grad

__all__ = ["KERNELS"]

Kernel = Callable[..., object]

KERNELS: dict[tuple[str, str], Kernel] = {
    ("ai.cann", "InplacePartialRotaryMul"): rotary_mul,
    ("ai.cann", "InplacePartialRotaryMulGrad"): rotary_mul_grad,
    ("ai.cann", "MoeTokenUnpermute"): moe_token_unpermute,
    ("ai.cann", "MoeTokenUnpermuteGrad"): moe_token_unpermute_grad,
    ("ai.cann", "SparseFlashAttention"): sparse_flash_attention,
    ("ai.cann", "SparseFlashAttentionGrad"): sparse_flash_attention_grad,
}
"""Kernels take the node's inputs positionally (None for absent ones) and its attributes by
keyword; ops with an aliased output also take ``out=`` (a buffer the runtime owns, possibly the
aliased input itself). They return one array or a tuple in output order."""
