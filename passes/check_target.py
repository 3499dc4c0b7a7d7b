"""CheckTarget: the device restrictions of ``schemas.targets``, collected into a report."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..ir._core import Graph
from ..ir._errors import GeirWarning, SourceLocation
from ..schemas import InferContext
from ..schemas.targets import rules_for, validate_target

from ._infra import Pass, PassResult

__all__ = ["CheckReport", "CheckTarget", "Violation"]


@dataclass(frozen=True)
class Violation:
    """One broken target rule at one node, with the rule's level and where CANN states it."""

    node: str
    op_type: str
    rule: str
    message: str
    location: SourceLocation | None = None
    level: str = "error"
    source: str = "code"

    def __str__(self) -> str:
        return self.message + (f" (node built at {self.location})" if self.location else "")


@dataclass
class CheckReport:
    """What ``geir.check`` found for a target. ``violations`` are the broken rules of level ``error`` (the
    device code refuses them) and ``unsupported`` (the docs forbid them, the device code accepts them);
    ``ok`` is False only for errors, unless ``strict`` counts unsupported too. Iterable over violations."""

    graph: str
    target: str
    violations: list[Violation] = field(default_factory=list)
    warnings: list[Violation] = field(default_factory=list)
    """``..-W#`` findings: reported (and emitted as GeirWarning), never a failure."""
    strict: bool = False

    @property
    def errors(self) -> list[Violation]:
        return [v for v in self.violations if v.level == "error"]

    @property
    def unsupported(self) -> list[Violation]:
        return [v for v in self.violations if v.level == "unsupported"]

    @property
    def ok(self) -> bool:
        return not (self.violations if self.strict else self.errors)

    def rules(self) -> set[str]:
        return {v.rule for v in self.violations}

    def __iter__(self):
        return iter(self.violations)

    def __len__(self) -> int:
        return len(self.violations)

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        counts = f"{len(self.errors)} error(s), {len(self.unsupported)} unsupported"
        if not self.violations:
            head = f"graph '{self.graph}' on {self.target}: ok (no restriction violated)"
        else:
            verdict = "ok" if self.ok else "refused"
            head = f"graph '{self.graph}' on {self.target}: {verdict}: {counts}" + (" (strict)" if self.strict else "")
        lines = [head] + [f"  - {v.level} ({v.source}): {v}" for v in self.violations]
        lines += [f"  warning ({w.source}): {w}" for w in self.warnings]
        return "\n".join(lines)


class CheckTarget(Pass):
    """Evaluates every target rule that binds on ``target`` for every node; modifies nothing.

    Runs on a typed graph (all semantic rules already passed, as the contract requires).
    """

    requires = frozenset({"verified", "typed"})

    def __init__(self, target: str, strict: bool = False) -> None:
        self.target = validate_target(target)
        self.strict = strict
        self.report: CheckReport | None = None

    def call(self, graph: Graph) -> PassResult:
        report = CheckReport(graph.name, self.target, strict=self.strict)
        for node in graph.topological_order():
            types = [v.type if v is not None else None for v in node.inputs]
            ctx = InferContext(node.schema, node.name, types, node.attributes, symbols=graph.symbols,
                               location=node.location, target=self.target, sources=node.inputs)
            for rule in rules_for(node.schema, self.target):
                finding = rule.check(ctx)
                if finding is not None:
                    message = ctx.message(rule.rule, finding.subject, finding.expected, finding.got, finding.hint)
                    found = Violation(node.name, node.op_type, rule.rule, message, node.location, rule.level, rule.src)
                    if rule.level == "warning":
                        report.warnings.append(found)
                        warnings.warn(message, GeirWarning, stacklevel=4)
                    else:
                        report.violations.append(found)
        self.report = report
        return PassResult(graph, False)
