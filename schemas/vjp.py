"""The registry of vector-Jacobian products: one rule per op, declared beside its schema.

A rule ``rule(ctx, node, out_grads) -> in_grads`` gets the autodiff context of ``passes.autodiff`` (it
emits nodes into the derivative graph), the forward node and the cotangent of each output (None where none
flows), and returns one cotangent (or None) per input, each of that input's type. ``rewrite``, when given,
re-emits the forward node itself in the derivative graph (attention returns its softmax statistics there).
The op families register theirs (``schemas/<family>/vjp.py``); standard ONNX ops in ``standard_vjp``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..ir._core import CANN_DOMAIN

__all__ = ["VjpRule", "register_vjp", "vjp_ops", "vjp_rewrite", "vjp_rule"]

VjpRule = Callable[[Any, Any, list], Sequence]
Rewrite = Callable[[Any, Any, list], tuple]

_RULES: dict[tuple[str, str], VjpRule] = {}
_REWRITES: dict[tuple[str, str], Rewrite] = {}


def register_vjp(op_type: str, domain: str = CANN_DOMAIN, rewrite: Rewrite | None = None
                 ) -> Callable[[VjpRule], VjpRule]:
    """Register the VJP rule of ``op_type`` in ``domain`` ("" for standard ONNX ops)."""
    def decorate(rule: VjpRule) -> VjpRule:
        _RULES[(op_type, domain)] = rule
        if rewrite is not None:
            _REWRITES[(op_type, domain)] = rewrite
        return rule
    return decorate


def vjp_rule(op_type: str, domain: str) -> VjpRule | None:
    return _RULES.get((op_type, domain))


def vjp_rewrite(op_type: str, domain: str) -> Rewrite | None:
    return _REWRITES.get((op_type, domain))


def vjp_ops() -> list[str]:
    """Every op with a rule, sorted (for the error that names an op without one)."""
    return sorted(op for op, _ in _RULES)
