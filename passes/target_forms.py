"""The derivative in forms a target has: ``geir.grad(..., target=...)``.

Each op of ours that the VJP emitted (not a copy of a forward node) is checked against the target's rules
(``schemas.targets``: the kernel rows such as RP-T1, MG-T1, and every other rule of level ``error``). Where the
target refuses it, it is re-emitted as

1. its family's substitute (``schemas.vjp.register_substitute``): ops of ours that the target takes and that compute
   the same bits for every input the original accepts (the rotary grad as the forward with negated sin, where the
   tables are proven pair-duplicated), when the substitute proves that and the target takes them; else
2. its standard-op body, as export writes it (``expand_functions.our_function_body``): standard ONNX ops, which every
   device runs, the same math as the op (float32 inside, one rounding).

The report (``GradReport``) says, for every op of ours the VJP emitted, which form it has and why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..ir._core import CANN_DOMAIN, Graph, Node
from ..ir._editor import GraphEditor
from ..ir._schema import InferContext, OpSchema
from ..ir._types import TensorType
from ..schemas.patterns import GraphView
from ..schemas.targets import rules_for, validate_target
from ..schemas.vjp import substitute
from .build import build
from .expand_functions import expand_functions, our_function_body

__all__ = ["KERNEL", "STANDARD_OPS", "SUBSTITUTE", "GradForm", "GradReport", "for_target", "refused_rules"]

KERNEL = "kernel"
"""The op as the VJP emitted it (the target has a kernel for it, or no target was given)."""
SUBSTITUTE = "substitute"
"""Other ops of ours that the target takes, the same bits (the detail names them)."""
STANDARD_OPS = "standard ops"
"""The op's standard-op body (its ONNX function body), which every device runs."""


@dataclass(frozen=True)
class GradForm:
    """The form of one op of ours that the VJP emitted: ``form`` is ``KERNEL``, ``SUBSTITUTE`` or ``STANDARD_OPS``;
    ``refused`` the target's rules the op broke; ``detail`` what was emitted, or why no substitute."""

    node: str
    op_type: str
    form: str
    refused: tuple[str, ...] = ()
    detail: str = ""

    def __str__(self) -> str:
        why = f" (refused: {', '.join(self.refused)})" if self.refused else ""
        return f"{self.op_type} '{self.node}'{why} -> {self.form}" + (f": {self.detail}" if self.detail else "")


@dataclass
class GradReport:
    """What ``geir.grad`` emitted for the ops of ours in the derivative, for ``target`` (None: none given, every
    op as the VJP emits it). Iterable over the forms."""

    graph: str
    target: str | None
    forms: list[GradForm] = field(default_factory=list)

    def of(self, form: str) -> list[GradForm]:
        """The entries of one form."""
        return [f for f in self.forms if f.form == form]

    def __iter__(self) -> Iterator[GradForm]:
        return iter(self.forms)

    def __len__(self) -> int:
        return len(self.forms)

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        where = f" for {self.target}" if self.target else ""
        counts = ", ".join(f"{len(self.of(k))} {k}" for k in (KERNEL, SUBSTITUTE, STANDARD_OPS) if self.of(k))
        lines = [f"geir.grad '{self.graph}'{where}: {len(self.forms)} op(s) of ours emitted" +
                 (f" ({counts})" if counts else "")]
        return "\n".join(lines + [f"  {f}" for f in self.forms])


def refused_rules(schema: OpSchema, types: list[TensorType | None], attributes: Mapping[str, Any], graph: Graph,
                  node: Node, target: str) -> list[str]:
    """The IDs of the target's rules of level ``error`` that a node of ``schema`` with these input types and
    attributes breaks (as ``geir.check`` finds them; warnings and ``unsupported`` never refuse)."""
    ctx = InferContext(schema, node.name, types, attributes, symbols=graph.symbols, location=node.location,
                       target=target)
    return [rule.rule for rule in rules_for(schema, target) if rule.level == "error" and rule.check(ctx) is not None]


class _Context:
    """What a substitute works with: the builder of the new graph, a view of the old one, the target's verdict."""

    def __init__(self, builder: GraphEditor, graph: Graph, target: str) -> None:
        self.b = builder
        self.graph = graph
        self.view = GraphView(graph)
        self.target = target
        self._count = 0

    def fresh(self, stem: str) -> str:
        self._count += 1
        return f"target_{stem}_{self._count}"

    def refused(self, schema: OpSchema, types: list[TensorType | None], attributes: Mapping[str, Any],
                node: Node) -> list[str]:
        return refused_rules(schema, types, attributes, self.graph, node, self.target)


def for_target(graph: Graph, target: str | None, emitted: Callable[[Node], bool]) -> tuple[Graph, GradReport]:
    """``graph`` (built) with each op of ours for which ``emitted(node)`` holds in a form ``target`` has, and the
    report; ``graph`` itself when nothing changes. Raises GraphError for an unknown target (listing the known)."""
    report = GradReport(graph.name, target)
    ours = [n for n in graph.topological_order() if n.domain == CANN_DOMAIN and emitted(n)]
    if target is None:
        report.forms = [GradForm(n.name, n.op_type, KERNEL) for n in ours]
        return graph, report
    validate_target(target)
    refused = {n.name: refused_rules(n.schema, [v.type if v is not None else None for v in n.inputs], n.attributes,
                                     graph, n, target) for n in ours}
    forms: dict[str, GradForm] = {n.name: GradForm(n.name, n.op_type, KERNEL) for n in ours if not refused[n.name]}
    if len(forms) < len(ours):
        graph = _substituted(graph, target, refused, forms)
        bodies = {id(n) for n in graph.nodes if n.name in forms and forms[n.name].form == STANDARD_OPS}
        if bodies:
            graph = expand_functions(graph, bodies, lambda op_type, domain: False, our_function_body)
    report.forms = [forms[n.name] for n in ours]
    return graph, report


def _substituted(graph: Graph, target: str, refused: dict[str, list[str]], forms: dict[str, GradForm]) -> Graph:
    """A copy of ``graph`` with each refused node that has a substitute replaced by it; the form of every refused
    node entered in ``forms`` (``STANDARD_OPS`` for those left to be expanded)."""
    builder = GraphEditor(graph.name)
    ctx = _Context(builder, graph, target)

    def rewrite(node: Node, inputs: list) -> tuple | None:
        rules = refused.get(node.name)
        if not rules or node.name in forms:
            return None
        fn = substitute(node.op_type, node.domain)
        made = fn(ctx, node, inputs) if fn is not None else f"{node.op_type} has no substitute"
        if isinstance(made, str):
            forms[node.name] = GradForm(node.name, node.op_type, STANDARD_OPS, tuple(rules),
                                        f"its ONNX function body; no substitute: {made}")
            return None
        outputs, detail = made
        forms[node.name] = GradForm(node.name, node.op_type, SUBSTITUTE, tuple(rules), detail)
        return outputs
    builder.copy_from(graph, rewrite)
    return build(builder)
