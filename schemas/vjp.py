"""The vector-Jacobian products: one rule per op, declared beside its schema, in the one registry's slot.

A rule ``rule(ctx, node, out_grads) -> in_grads`` gets the autodiff context of ``passes.autodiff`` (it
emits nodes into the derivative graph), the forward node and the cotangent of each output (None where none
flows), and returns one cotangent (or None) per input, each of that input's type. ``rewrite``, when given,
re-emits the forward node itself in the derivative graph (attention returns its softmax statistics there).
The op families register theirs (``schemas/<family>/vjp.py``); standard ONNX ops in ``standard_vjp``.

A substitute ``substitute(ctx, node, inputs) -> (outputs, detail) | reason`` re-emits a node the VJP emitted whose
op a target refuses, as ops of ours the target takes and that compute the same bits for every input (``ctx``:
``passes.target_forms``); it returns why not when it cannot, and the op's standard-op body is used instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..ir._core import CANN_DOMAIN
from ..ir._registry import Slot

__all__ = ["SUBSTITUTES", "VJP_REWRITES", "VJP_RULES", "Substitute", "VjpRule", "register_substitute", "register_vjp",
           "substitute", "vjp_ops", "vjp_rewrite", "vjp_rule"]

VjpRule = Callable[[Any, Any, list], Sequence]
Rewrite = Callable[[Any, Any, list], tuple]

VJP_RULES: Slot[VjpRule] = Slot("VJP rules")
VJP_REWRITES: Slot[Rewrite] = Slot("VJP rewrites of the forward node")
Substitute = Callable[[Any, Any, list], "tuple[tuple, str] | str"]
SUBSTITUTES: Slot[Substitute] = Slot("substitutes of emitted ops a target refuses")


def register_vjp(op_type: str, domain: str = CANN_DOMAIN, rewrite: Rewrite | None = None
                 ) -> Callable[[VjpRule], VjpRule]:
    """Register the VJP rule of ``op_type`` in ``domain`` ("" for standard ONNX ops)."""
    def decorate(rule: VjpRule) -> VjpRule:
        VJP_RULES.register(domain, op_type, rule)
        if rewrite is not None:
            VJP_REWRITES.register(domain, op_type, rewrite)
        return rule
    return decorate


def vjp_rule(op_type: str, domain: str) -> VjpRule | None:
    return VJP_RULES.get((domain, op_type))


def vjp_rewrite(op_type: str, domain: str) -> Rewrite | None:
    return VJP_REWRITES.get((domain, op_type))


def vjp_ops() -> list[str]:
    """Every op with a rule, sorted (for the error that names an op without one)."""
    return sorted(op for _, op in VJP_RULES)


def register_substitute(op_type: str, domain: str = CANN_DOMAIN) -> Callable[[Substitute], Substitute]:
    """Register the substitute of ``op_type`` (see the module docstring)."""
    def decorate(fn: Substitute) -> Substitute:
        SUBSTITUTES.register(domain, op_type, fn)
        return fn
    return decorate


def substitute(op_type: str, domain: str) -> Substitute | None:
    return SUBSTITUTES.get((domain, op_type))
