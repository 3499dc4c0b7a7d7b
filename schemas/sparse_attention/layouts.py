"""The layouts of the sparse attention ops, read from a node's attributes (shared by rules, checks and kernels)."""

from __future__ import annotations

from ...ir._schema import DataContext, InferContext

__all__ = ["LAYOUTS", "PAGED", "attention_layout", "is_paged"]

LAYOUTS = ("BSND", "TND")
PAGED = "PA_BSND"
"""``layout_kv`` of a paged KV cache read through ``block_table`` (spec 4.11)."""


def attention_layout(ctx: InferContext | DataContext) -> str:
    """The query layout: the forward's ``layout_query``, the grad's ``layout``."""
    return ctx.attr("layout_query") if "layout_query" in ctx.attributes else ctx.attr("layout")


def is_paged(ctx: InferContext | DataContext) -> bool:
    """Whether key/value/key_rope are a paged cache read through block_table (spec 4.11)."""
    return "layout_kv" in ctx.attributes and ctx.attr("layout_kv") == PAGED
