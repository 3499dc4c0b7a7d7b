"""Errors and warnings raised by geir, and the record of where user code built a node."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

__all__ = [
    "ExecutionError",
    "GeirWarning",
    "GraphError",
    "SourceLocation",
    "first_line",
    "format_rule_message",
    "user_location",
]


@dataclass(frozen=True)
class SourceLocation:
    """The line of user code (outside geir) that created a node."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno} in {self.function}"


_ENTRY_POINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__main__.py")
"""``python -m geir`` runs this file as ``__main__``: geir's, not the user's."""


def user_location() -> SourceLocation | None:
    """Return the innermost stack frame that does not belong to geir itself."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != "geir" and not module.startswith("geir.") and frame.f_code.co_filename != _ENTRY_POINT:
            code = frame.f_code
            return SourceLocation(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (onnx's and ONNX Runtime's run over many), or its type."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def format_rule_message(
    rule: str,
    op_type: str,
    node: str,
    subject: str,
    expected: object,
    got: object,
    *,
    hint: str | None = None,
    target: str | None = None,
) -> str:
    """Format a violation as ``[ID] Op 'node'[ on target]: subject: expected X, got Y[; hint]``."""
    where = f" on {target}" if target else ""
    text = f"[{rule}] {op_type} '{node}'{where}: {subject}: expected {expected}, got {got}"
    if hint:
        text += f"; {hint}"
    return text


class GraphError(ValueError):
    """Something is wrong with a graph; found while building, verifying or importing it.

    Attributes:
        rule: the contract's rule ID (``RP-S7``, ``SCH-5``, ...), or None for structural errors.
        node: the name of the offending node, if any.
        location: where user code built that node, if known.
    """

    def __init__(
        self,
        message: str,
        *,
        rule: str | None = None,
        node: str | None = None,
        location: SourceLocation | None = None,
    ) -> None:
        self.message = message
        self.rule = rule
        self.node = node
        self.location = location
        super().__init__(message + (f"\n  (node built at {location})" if location else ""))


class ExecutionError(RuntimeError):
    """Bad data found while running a graph: a feed, or a kernel's input values.

    Attributes:
        node: the name of the node being executed, or None for feed errors.
        rule: the contract's data-validation rule ID (``MU-D1``, ...), if one applies.
    """

    def __init__(self, message: str, *, node: str | None = None, rule: str | None = None) -> None:
        self.node = node
        self.rule = rule
        super().__init__(message)


class GeirWarning(UserWarning):
    """A contract warning (``..-W#``): suspicious but valid; never stops verification."""
