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
from ..ir._registry import Rows, Slot

from ..ir._schema import InferContext, OpSchema

__all__ = ["A2", "A3", "A5", "ASCEND_TRAINING", "K9030", "KX90", "LEVELS", "P310", "TARGETS", "Finding", "TargetRule",
           "kernel_rule", "kernel_targets", "ops_with_kernels", "register_target_rules", "rules_for", "validate_target"]

A2, A3, A5 = "ascend910b", "ascend910_93", "ascend950"
P310, KX90, K9030 = "ascend310p", "kirinx90", "kirin9030"
ASCEND_TRAINING = frozenset({A2, A3, A5})
"""Atlas A2, Atlas A3, Ascend 950PR/950DT: where all six ops have kernels (but RP-T1, MU-T1, MG-T1)."""
TARGETS: tuple[str, ...] = (A2, A3, A5, P310, KX90, K9030)
"""Every device an op definition of the six ops registers (ascend310p and the Kirin chips: MoeTokenUnpermute only)."""

LEVELS = ("error", "unsupported", "warning")
"""error: the device's code refuses it; unsupported: the docs forbid it but the device code accepts it
(undocumented behaviour); warning: suspicious, never a failure."""


@dataclass(frozen=True)
class Finding:
    subject: str
    expected: object
    got: object
    hint: str | None = None


@dataclass(frozen=True)
class TargetRule:
    """One row: ``src`` says where CANN states the rule (``code``: op def / tiling / kernel; ``doc``: the
    public docs only), and ``level`` follows from it unless given (code -> error, doc -> unsupported)."""

    rule: str
    schema: OpSchema
    targets: frozenset[str]
    check: Callable[[InferContext], Finding | None]
    src: str = "code"
    warning: bool = False
    """A ``..-W#`` row: reported as a warning, never a violation."""
    level: str = ""

    def __post_init__(self) -> None:
        level = self.level or ("warning" if self.warning else "unsupported" if self.src.startswith("doc") else "error")
        if level not in LEVELS:
            raise ValueError(f"target rule {self.rule}: level: expected one of {', '.join(LEVELS)}, got {level!r}")
        object.__setattr__(self, "level", level)


def validate_target(target: str) -> str:
    if target not in TARGETS:
        raise GraphError(f"unknown target {target!r}: expected one of {', '.join(TARGETS)}")
    return target


TARGET_ROWS: Rows[TargetRule] = Rows("device restriction rows")
"""Every family's rows (``schemas/<family>/targets.py`` registers them), per op."""


def register_target_rules(*rules: TargetRule) -> None:
    for rule in rules:
        TARGET_ROWS.add(rule.schema.domain, rule.schema.op_type, rule)


KERNEL_TARGETS: Slot[frozenset[str]] = Slot("CANN kernel targets")
"""(domain, op type) -> the targets where CANN has a kernel of the op."""


def kernel_rule(rule: str, schema: OpSchema, available: frozenset[str], hint: str | None = None,
                src: str = "code (op def)") -> TargetRule:
    """Record where ``schema`` has a kernel, and the row that refuses every other target, naming the op and it."""
    KERNEL_TARGETS.register(schema.domain, schema.op_type, available)
    shown = ", ".join(t for t in TARGETS if t in available)

    def no_kernel(ctx: InferContext) -> Finding:
        return Finding("op", f"a target with a {schema.op_type} kernel ({shown})", ctx.target, hint)
    return TargetRule(rule, schema, frozenset(TARGETS) - available, no_kernel, src=src)


def kernel_targets(schema: OpSchema) -> frozenset[str]:
    """The targets where CANN has a kernel of ``schema``."""
    return KERNEL_TARGETS.get((schema.domain, schema.op_type), frozenset())


def ops_with_kernels(target: str) -> list[str]:
    """The op types with a kernel on ``target``, in registration order."""
    validate_target(target)
    return [op for (_, op), targets in KERNEL_TARGETS.items() if target in targets]


def rules_for(schema: OpSchema, target: str) -> list[TargetRule]:
    """The rows of ``schema`` (matched by (domain, op type)) that bind on ``target``."""
    return [r for r in TARGET_ROWS.of(schema.domain, schema.op_type) if target in r.targets]
