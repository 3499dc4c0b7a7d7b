"""Rewrite standard-op subgraphs into our ops (``geir.fuse``): the patterns of ``schemas.patterns``.

Every node whose op type is a pattern's anchor is offered to the patterns of that anchor, in topological
order, in one sweep (patterns compose: a rope on a slice of the head dim is first a rope, then a partial rope,
and the rope's Add comes before the Concat), repeated only while a sweep fused something. Each match is
applied in place, and what it leaves dead is unlinked at once and swept from the node list once per sweep:
the work is linear in the graph's size (a graph is never rebuilt per match).

What every match must satisfy is checked here, in one place, whatever the pattern:
- our op, built from the match through a GraphEditor, passes every schema rule (a rule that fails turns
  the match into a near miss with the rule's message) and gives the type of the value it replaces;
- a narrowing integer cast saturates (``Match.casts``): a fed int64 index out of int32's range stays out of
  range, never wraps into it;
- the op's run-time data rules pass on its inputs that are constants (a constant index table it would refuse on
  every run is a near miss now);
- an input that those data rules read and that is not a constant (fed, or computed in the graph) makes a near miss
  unless the caller allows stricter data (``allow_stricter_data``): the rules may refuse values the subgraph
  computes with (a key id twice in an attention row, MoE indices that are not a permutation), and a rewrite is
  correct for every input the original accepts or it does not fire. Allowed, such values are refused with an
  ``ExecutionError`` when the fused graph runs, never computed into another result. So does a match whose
  pattern says on which data the op's meaning differs (``Match.differs_on``: a slot of weight 0 or a padded key
  that the op skips and the subgraph multiplies by 0, so that a non-finite value there is NaN in the subgraph
  only); allowed, the op's (CANN's) meaning holds on that data;
- the graph still exports: a model holds one ONNX function body per op (``ir/_onnx_export``), so a match whose
  op would need another body than the op's nodes already in the graph (other optional inputs present, other
  layout) is a near miss that says so.
Then the replaced value's uses move to the new node (which keeps the graph's output name). The graph's
interface (inputs, outputs, their names and types) is unchanged. The patterns themselves own the data
semantics (index conventions, masks) and prove them in tests/passes/test_fusion_properties.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ir._core import CANN_DOMAIN, Graph, Node, Value
from ..ir._editor import GraphEditor
from ..ir._errors import ExecutionError, GraphError
from ..ir._onnx_export import lowering_spec
from ..ir._lowering import LOWERINGS, LoweringSpec
from ..ir._registry import get_schema
from ..ir._schema import DataContext, InferContext
from ..schemas.patterns import INT32, GraphView, Match, NearMiss, Pattern, patterns
from ._infra import Pass, PassResult
from .build import build

__all__ = ["Fuse", "FusionReport", "Fused", "Missed", "apply_patterns"]


@dataclass(frozen=True)
class Fused:
    pattern: str
    replaced: tuple[str, ...]
    """Names of the standard nodes the new node stands for."""
    became: str
    """``<OpType> '<node name>'`` of the new node."""


@dataclass(frozen=True)
class Missed:
    pattern: str
    node: str
    reason: str


@dataclass
class FusionReport:
    """What ``geir.fuse`` did: each match (pattern, nodes replaced, the op it became) and each near miss."""

    graph: str
    fused: list[Fused] = field(default_factory=list)
    near_misses: list[Missed] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"geir.fuse '{self.graph}': {len(self.fused)} fused, {len(self.near_misses)} near misses"]
        for f in self.fused:
            lines.append(f"  fused  {f.pattern}: {len(f.replaced)} nodes ({', '.join(f.replaced)}) -> {f.became}")
        for m in self.near_misses:
            lines.append(f"  missed {m.pattern} at '{m.node}': {m.reason}")
        return "\n".join(lines)


INT32_RANGE = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)


def _body_key(node: Node) -> LoweringSpec | None:
    """What our op's exported function body depends on (``ir/_onnx_export.lowering_spec``, the export's own rule);
    None for an op without a lowering."""
    return lowering_spec(node, node.schema) if (node.domain, node.op_type) in LOWERINGS else None


class _Fusion:
    """One run of the pass over ``graph``: the builder extending it, the nodes each match left dead, the body
    each of our op types exports with, and the report."""

    def __init__(self, graph: Graph, allow_stricter_data: bool) -> None:
        self.graph = graph
        self.allow_stricter_data = allow_stricter_data
        self.builder = GraphEditor.extend(graph)
        self.report = FusionReport(graph.name)
        self.view = GraphView(graph)
        self.count = 0
        self.dead: list[Node] = []
        self.orphans: list[Value] = []
        self.outputs = {id(v) for v in graph.outputs}
        self.bodies: dict[str, tuple[LoweringSpec | None, str]] = {}
        for node in graph.nodes:
            if node.domain == CANN_DOMAIN:
                self.bodies.setdefault(node.op_type, (_body_key(node), node.name))
        self.seen_misses: set[tuple[str, str]] = set()
        self.by_anchor: dict[str, list[Pattern]] = {}
        for pattern in patterns():
            self.by_anchor.setdefault(pattern.anchor, []).append(pattern)

    def sweep(self) -> bool:
        """Offer every standard node to its anchor's patterns in topological order; whether anything fused."""
        fused = False
        for node in self.graph.topological_order():
            for pattern in self.by_anchor.get(node.op_type, ()) if node.domain == "" else ():
                if node.graph is not self.graph:
                    break                                  # consumed by an earlier match
                try:
                    result = pattern.match(self.view, node)
                except Exception as exc:   # a graph the matcher did not foresee: reported, never a crash
                    result = NearMiss(f"the matcher failed on this node ({type(exc).__name__}: {exc})")
                if isinstance(result, Match):
                    result = self.fuse(pattern, result)
                    if result is None:
                        fused = True
                        break
                if isinstance(result, NearMiss):
                    key = (pattern.name, node.name)      # once, though later sweeps number our node anew
                    if key not in self.seen_misses:
                        self.seen_misses.add(key)
                        self.report.near_misses.append(Missed(pattern.name, node.name, result.reason))
        self.drop_dead()
        return fused

    def fuse(self, pattern: Pattern, match: Match) -> NearMiss | None:
        """Apply ``match``; a NearMiss (and the graph as before) when our op or the export refuses it."""
        self.count += 1
        name = f"fused_{match.op}_{self.count}"
        nodes, constants = len(self.graph.nodes), len(self.graph.constant_values)
        try:
            new = self.build(match, name)
        except GraphError as exc:
            self.undo(nodes, constants)
            return NearMiss(f"{match.op} refused it: {str(exc).splitlines()[0]}")
        old = match.replaces
        old.replace_all_uses_with(new, self.graph)
        if id(old) in self.outputs:
            self.outputs.discard(id(old))
            self.outputs.add(id(new))
            new.name = old.name
        self.unlink_dead(old.producer)
        replaced = tuple(dict.fromkeys(n.name for n in match.nodes))    # a Split giving several pieces: named once
        self.report.fused.append(Fused(pattern.name, replaced, f"{match.op} '{name}'"))
        return None

    def build(self, match: Match, name: str) -> Value:
        """Add our op for ``match`` (its rules checked on creation) and what converts its inputs and output."""
        builder = self.builder
        if not self.allow_stricter_data:
            if match.differs_on:
                raise GraphError(f"{match.differs_on}; pass allow_stricter_data=True (geir fuse "
                                 f"--allow-stricter-data) to fuse it with the op's meaning")
            self.check_no_stricter_data(match)
        inputs = list(match.inputs)
        for index, transform in match.transforms.items():
            inputs[index] = transform(builder, inputs[index], f"{name}_convert{index}")
        for index, dtype in match.casts.items():
            value = inputs[index]
            if dtype == INT32 and value.type.dtype.numpy.kind in "iu" and value.type.dtype.numpy.itemsize > 4:
                low, high = (builder.constant(f"{name}_{end}{index}", np.array(bound, value.type.dtype.numpy))
                             for end, bound in zip(("min", "max"), INT32_RANGE))
                value = builder.op("Clip", value, low, high, name=f"{name}_saturate{index}")
            inputs[index] = builder.op("Cast", value, to=dtype, name=f"{name}_cast{index}")
        for index, shape in match.reshapes.items():
            target = builder.constant(f"{name}_shape{index}", np.asarray(shape, np.int64))
            inputs[index] = builder.op("Reshape", inputs[index], target, name=f"{name}_reshape{index}")
        for index, array in match.constants.items():
            inputs[index] = builder.constant(f"{name}_input{index}", array)
        result = getattr(builder, match.op)(*inputs, name=name, **match.attributes)
        new = result[match.output_index] if isinstance(result, tuple) else result
        key, (body, owner) = _body_key(new.producer), self.bodies.get(match.op, (None, ""))
        if owner and key != body:
            raise GraphError(f"the graph could no longer be exported: {match.op} '{owner}' already has an ONNX "
                             f"function body of another form (optional inputs, layout), and a model holds one per op")
        if not self.allow_stricter_data:
            self.check_shapes_decided(new.producer)
        self.check_constant_data(new.producer)
        if match.finish is not None:
            new = match.finish(builder, new, inputs, f"{name}_finish")
        old = match.replaces
        if match.same_symbols and new.type.dtype == old.type.dtype and len(new.type.shape) == len(old.type.shape) \
                and all(a == b or isinstance(a, str) and isinstance(b, str) for a, b in zip(new.type.shape,
                                                                                          old.type.shape)):
            for a, b in zip(new.type.shape, old.type.shape):
                if a != b:
                    self.graph.symbols.declare_equal(a, b)
        elif new.type.dtype != old.type.dtype or tuple(new.type.shape) != tuple(old.type.shape):
            raise GraphError(f"{match.op} would give {new.type} where the subgraph gives {old.type}")
        self.bodies.setdefault(match.op, (key, name))
        return new

    def check_no_stricter_data(self, match: Match) -> None:
        """Refuse (GraphError, a near miss) a match whose op's data rules would read a value that is not a constant:
        the rules may refuse what the subgraph accepts, so the rewrite would not hold for every input."""
        schema = get_schema(match.op)
        for index, (spec, value) in enumerate(zip(schema.inputs, match.inputs)):
            if (spec.name in schema.validated_inputs and index not in match.constants and value is not None
                    and value.name not in self.graph.constants):
                raise GraphError(
                    f"input '{spec.name}' ({value.name}) is not a constant, and {match.op} checks it when the graph "
                    f"runs more strictly than this subgraph (e.g. distinct key ids per row, a permutation of rows): "
                    f"fused, a value the subgraph computes with would be refused; pass allow_stricter_data=True "
                    f"(geir fuse --allow-stricter-data) to fuse and have such values refused at run time")

    def check_shapes_decided(self, node: Node) -> None:
        """Refuse (GraphError, a near miss) a node whose schema rules a symbolic dim leaves undecided: on fed shapes
        the op could refuse what the subgraph accepts (a table of symbolic size B that broadcasts when B is 1, say)."""
        schema = node.schema
        values = [self.graph.constants.get(v.name) if v is not None and v.producer is None else None
                  for v in node.inputs]
        ctx = InferContext(schema, node.name, [v.type if v is not None else None for v in node.inputs],
                           node.attributes, symbols=self.graph.symbols, input_values=values)
        schema.infer_types(ctx)
        if ctx.deferred:
            raise GraphError(f"its rules {', '.join(sorted(set(ctx.deferred)))} depend on symbolic dims this graph "
                             f"does not decide, so the op could refuse shapes the subgraph accepts (a dim that "
                             f"broadcasts when it is 1, say); give static shapes or declare_equal the symbols, or pass "
                             f"allow_stricter_data=True (geir fuse --allow-stricter-data) to fuse and have such shapes "
                             f"refused at run time")

    def check_constant_data(self, node: Node) -> None:
        """Run the op's run-time data rules (``..-D#``) now when every value they read is a constant: a match the
        op would refuse on every run is a near miss (GraphError), whatever the pattern checked itself."""
        schema = node.schema
        if schema.validate is None:
            return
        arrays: list[np.ndarray | None] = []
        for spec, value in zip(schema.inputs, node.inputs):
            array = None if value is None or value.producer is not None else self.graph.constants.get(value.name)
            if value is not None and array is None:
                if spec.name in schema.validated_inputs or not value.type.is_static:
                    return                                 # known only when the graph runs: checked then
                array = np.broadcast_to(np.zeros((), value.type.dtype.numpy), tuple(int(d) for d in value.type.shape))
            arrays.append(array)
        try:
            schema.validate(DataContext(schema, node.name, arrays, node.attributes, location=node.location))
        except ExecutionError as exc:
            raise GraphError(f"its run-time data rules refuse the constant inputs: {exc}") from None

    def unlink_dead(self, start: Node | None) -> None:
        """Unlink ``start`` and, transitively, the producers only it used, when no node or graph output reads
        them any more (only the matched region is visited)."""
        stack = [start]
        while stack:
            node = stack.pop()
            if node is None or node.graph is not self.graph or any(
                    v is not None and (v.uses or id(v) in self.outputs) for v in node.outputs):
                continue
            node.graph = None                              # skipped by the sweep, swept from the list after it
            self.dead.append(node)
            for i, value in enumerate(node.inputs):
                if value is None:
                    continue
                node.set_input(i, None)
                if value.producer is not None:
                    stack.append(value.producer)
                elif not value.uses and value.name in self.graph.constants:
                    self.orphans.append(value)

    def drop_dead(self) -> None:
        """Sweep the unlinked nodes and the constants only they read (slice bounds, axes) in one pass each."""
        if self.dead:
            self.graph.nodes = [n for n in self.graph.nodes if n.graph is self.graph]
            self.dead = []
        orphans = {id(v) for v in self.orphans if not v.uses and id(v) not in self.outputs}
        if orphans:
            for value in self.graph.constant_values:
                if id(value) in orphans:
                    del self.graph.constants[value.name]
            self.graph.constant_values = [v for v in self.graph.constant_values if id(v) not in orphans]
        self.orphans = []
        self.graph.invalidate()

    def undo(self, nodes: int, constants: int) -> None:
        """Remove what a refused match added (the nodes and constants appended since), so the graph is as before."""
        for node in self.graph.nodes[nodes:]:
            node.graph = None
            for i in range(len(node.inputs)):
                node.set_input(i, None)
        del self.graph.nodes[nodes:]
        for value in self.graph.constant_values[constants:]:
            del self.graph.constants[value.name]
        del self.graph.constant_values[constants:]


def apply_patterns(graph: Graph, *, allow_stricter_data: bool = False) -> FusionReport:
    """Fuse ``graph`` in place (the caller passes a copy, and builds it after: verified, typed);
    ``allow_stricter_data``: fuse where the op's run-time data rules read a value that is not a constant (see the
    module docstring)."""
    fusion = _Fusion(graph, allow_stricter_data)
    while fusion.sweep():
        pass
    return fusion.report


class Fuse(Pass):
    """The pass form of fusion: rewrites the graph in place and builds it again; ``report`` tells what fused
    and each near miss. ``geir.fuse`` runs it on a copy, so the caller's graph is never changed."""

    requires = frozenset({"verified", "typed"})
    ensures = frozenset({"verified", "typed"})

    def __init__(self, *, allow_stricter_data: bool = False) -> None:
        self.allow_stricter_data = allow_stricter_data
        self.report = FusionReport("")

    def call(self, graph: Graph) -> PassResult:
        self.report = apply_patterns(graph, allow_stricter_data=self.allow_stricter_data)
        return PassResult(build(GraphEditor.extend(graph)), bool(self.report.fused))
