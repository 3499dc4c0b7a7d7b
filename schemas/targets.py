"""Per-device restrictions (the contract's ``..-T#`` target rules), as data: the machinery here, the
rows in each family's ``targets.py``.

Each row is one rule of the spec's target tables: its ID, op, the targets it binds on, the
source CANN states it in, and a predicate that returns a Finding when a node breaks it (or
None: satisfied, not applicable -- the table's "when" column -- or undecidable on symbols).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..ir._errors import GraphError

from ._schema import InferContext, OpSchema

__all__ = ["A2", "A3", "A5", "TARGETS", "Finding", "TargetRule", "register_target_rules", "rules_for",
           "validate_target"]

A2, A3, A5 = "ascend910b", "ascend910_93", "ascend950"
TARGETS: tuple[str, ...] = (A2, A3, A5)
"""Atlas A2, Atlas A3, Ascend 950PR/950DT."""


@dataclass(frozen=True)
class Finding:
    subject: str
    expected: object
    got: object
    hint: str | None = None


@dataclass(frozen=True)
class TargetRule:
    rule: str
    schema: OpSchema
    targets: frozenset[str]
    check: Callable[[InferContext], Finding | None]
    src: str = "code"
    warning: bool = False
    """A ``..-W#`` row: reported as a warning, never a violation."""


def validate_target(target: str) -> str:
    if target not in TARGETS:
        raise GraphError(f"unknown target {target!r}: expected one of {', '.join(TARGETS)}")
    return target


_RULES: list[TargetRule] = []
"""Every family's rows (``schemas/<family>/targets.py`` registers them)."""


def register_target_rules(*rules: TargetRule) -> None:
    _RULES.extend(rules)


def rules_for(schema: OpSchema, target: str) -> list[TargetRule]:
    """The rows of ``schema`` (matched by (domain, op type)) that bind on ``target``."""
    key = (schema.domain, schema.op_type)
    return [r for r in _RULES if (r.schema.domain, r.schema.op_type) == key and target in r.targets]
