"""What an op's call returns, in words generated from its schema: ``help()`` of the builder method
(``_editor``) and of the ``ge.op`` class (``tools/ge/_operator.py``, and ``op.pyi``) say it from here."""

from __future__ import annotations

from ._schema import Schema

__all__ = ["output_doc"]


def output_doc(schema: Schema, absent: str = "") -> list[str]:
    """One line per output, its name and doc, an optional one marked (``absent``: what it is when absent, as the
    builder returns it, "None when absent").

    Only an output the schema declares optional may be absent; every other one is always there (an output whose
    content depends on an attribute, as SparseFlashAttention's statistics without return_softmax_lse, says what it
    is then in its own doc)."""
    marker = f" (optional: {absent})" if absent else " (optional)"
    return [spec.name + (marker if spec.optional else "") + (f": {spec.doc}" if spec.doc else "")
            for spec in schema.outputs]
