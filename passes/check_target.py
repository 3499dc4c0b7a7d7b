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
    """One broken target rule at one node."""

    node: str
    op_type: str
    rule: str
    message: str
    location: SourceLocation | None = None

    def __str__(self) -> str:
        return self.message + (f" (node built at {self.location})" if self.location else "")


@dataclass
class CheckReport:
    """What ``geir.check`` found for a target; ``ok`` when nothing. Iterable over violations."""

    graph: str
    target: str
    violations: list[Violation] = field(default_factory=list)
    warnings: list[Violation] = field(default_factory=list)
    """``..-W#`` findings: reported (and emitted as GeirWarning), never a failure."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def rules(self) -> set[str]:
        return {v.rule for v in self.violations}

    def __iter__(self):
        return iter(self.violations)

    def __len__(self) -> int:
        return len(self.violations)

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        if self.ok:
            text = f"graph '{self.graph}' on {self.target}: ok (no restriction violated)"
            return "\n".join([text] + [f"  warning: {w}" for w in self.warnings])
        lines = [f"graph '{self.graph}' on {self.target}: {len(self.violations)} violation(s)"]
        lines += [f"  - {v}" for v in self.violations]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


class CheckTarget(Pass):
    """Evaluates every target rule that binds on ``target`` for every node; modifies nothing.

    Runs on a typed graph (all semantic rules already passed, as the contract requires).
    """

    requires = frozenset({"verified", "typed"})

    def __init__(self, target: str) -> None:
        self.target = validate_target(target)
        self.report: CheckReport | None = None

    def call(self, graph: Graph) -> PassResult:
        report = CheckReport(graph.name, self.target)
        for node in graph.topological_order():
            types = [v.type if v is not None else None for v in node.inputs]
            ctx = InferContext(node.schema, node.name, types, node.attributes, symbols=graph.symbols,
                               location=node.location, target=self.target)
            for rule in rules_for(node.schema, self.target):
                finding = rule.check(ctx)
                if finding is not None:
                    message = ctx.message(rule.rule, finding.subject, finding.expected, finding.got, finding.hint)
                    found = Violation(node.name, node.op_type, rule.rule, message, node.location)
                    if rule.warning:
                        report.warnings.append(found)
                        warnings.warn(message, GeirWarning, stacklevel=4)
                    else:
                        report.violations.append(found)
        self.report = report
        return PassResult(graph, False)
