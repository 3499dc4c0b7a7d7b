"""Reverse-mode differentiation of a built graph: ``geir.grad(graph, wrt=None, outputs=None)``.

The result is a new graph: the forward graph's inputs plus one cotangent input ``grad_<output>`` per
differentiated output, in the order of the outputs; its outputs are the forward outputs followed by
``grad_<input>`` for each input of ``wrt``. Where a cotangent's name is taken (a pass-through output x, whose
``grad_x`` is the gradient of input x), it is ``grad_<output>_cotangent``. The forward nodes are copied (a rule may rewrite its node, as attention does to return its
softmax statistics), then every node that lies between a ``wrt`` input and a differentiated output
gets its vector-Jacobian product from the rule registered for its op, in reverse topological order;
contributions to one value are summed with Add.

Rules live with their op families (``schemas/<family>/vjp.py``, ``schemas/standard_vjp.py``) and
register with ``schemas.vjp.register_vjp``. The derivative graph is emitted through a ``GraphEditor``, so
every node is checked as it is added, and built at the end. A rule receives the
``VjpContext`` (which emits nodes into the new graph), the forward node and the cotangent of each output
(None where none flows), and returns one cotangent (or None) per input, each of that input's type. An op
without a rule is a GraphError naming it.

With a ``target``, each op of ours that the rules emitted and the target refuses is re-emitted in a form the target
has (``target_forms``), and the ``GradReport`` says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..ir._core import Graph, Node, Value, unused_name
from ..ir._editor import GraphEditor
from ..ir._errors import GraphError
from ..ir._onnx_body import OPSET
from ..ir._types import TensorType
from ..schemas.targets import validate_target
from ..schemas.vjp import vjp_ops, vjp_rewrite, vjp_rule
from ._infra import Pass, PassResult
from .expand_functions import defines_by_body, expand_functions
from .build import build
from .dead_code import EliminateDeadCode, drop_unused_constants
from .target_forms import GradReport, for_target

__all__ = ["ACCOUNTED", "Differentiate", "VjpContext", "differentiate", "differentiate_for"]

ACCOUNTED = object()
"""What a rule returns for an input whose cotangent it has already added to another input's (attention's KV
merge adds d_value into d_key when value is key's prefix)."""


class VjpContext:
    """What a rule works with: the new graph's builder, the forward-to-new value map, small emitters."""

    def __init__(self, builder: GraphEditor, forward: Graph) -> None:
        self.b = builder
        self.forward = forward
        self.mapping: dict[int, Value] = {}
        self._count = 0
        self.depends: set[int] = set()
        """ids of the forward values that depend on the inputs differentiated (set by ``differentiate``)."""
        self.state: dict[int, Any] = {}
        """Per forward node, what its rewrite left for its rule (attention: the statistics it now returns)."""
        self.memo: dict[str, Any] = {}
        """Facts about the forward graph a rule family computes once per derivative (the MoE nodes' form)."""

    # -- values ------------------------------------------------------------------------------------
    accounted = ACCOUNTED

    def new(self, value: Value | None) -> Value | None:
        """The new graph's value for a forward value (None stays None)."""
        return None if value is None else self.mapping[id(value)]

    def needs(self, value: Value | None) -> bool:
        """Whether a forward value needs a cotangent (it depends on an input differentiated): rules skip the others."""
        return value is not None and id(value) in self.depends

    def constant_of(self, value: Value | None) -> np.ndarray | None:
        """The array of a forward value that is a graph constant, else None."""
        if value is None or value.producer is not None:
            return None
        return self.forward.constants.get(value.name)

    def fresh(self, stem: str) -> str:
        self._count += 1
        return f"vjp_{stem}_{self._count}"

    def const(self, array: np.ndarray, stem: str = "const") -> Value:
        return self.b.constant(self.fresh(stem), np.asarray(array))

    def ints(self, values: Sequence[int]) -> Value:
        return self.const(np.asarray(list(values), np.int64), "ints")

    def op(self, op_type: str, *inputs: Value | None, **attributes: Any) -> Any:
        """A standard ONNX op (or one of ours) in the new graph; returns its output(s). A Reshape's target is always a
        full shape here, so a 0 in it is a size 0 (``allowzero``), never ONNX's "copy this dim"."""
        if op_type == "Reshape" and not attributes:
            attributes = {"allowzero": 1}
        return self.b.op(op_type, *inputs, name=self.fresh(op_type.lower()), **attributes)

    def cast(self, value: Value, like: TensorType) -> Value:
        return value if value.type.dtype == like.dtype else self.op("Cast", value, to=like.dtype.onnx)

    def shape_of(self, value: Value) -> Value:
        """The shape of a new-graph value as an int64 vector: a constant when static (so inference keeps the
        dims), else Shape(value)."""
        if value.type.is_static:
            return self.ints(value.type.shape)
        return self.op("Shape", value)

    def zeros_like(self, value: Value) -> Value:
        """Zeros of a new-graph value's type."""
        t = value.type
        if t.is_static:
            return self.const(np.zeros(t.shape, t.dtype.numpy), "zeros")
        zero = self.const(np.zeros((1,), t.dtype.numpy), "zero")
        return self.op("Expand", zero, self.shape_of(value))

    def sum_to(self, grad: Value, like: Value) -> Value:
        """``grad`` (of a broadcast result) summed over the axes where ``like`` (a new-graph value) was
        broadcast, then shaped as ``like``: the cotangent of a broadcast operand. Where the types cannot tell
        whether a dim was broadcast (a symbol against another, or against a number other than 1), the graph
        decides it from the shapes at run time: a dim of ``like`` that is 1 where the cotangent's is not."""
        out, target = tuple(grad.type.shape), tuple(like.type.shape)
        lead = len(out) - len(target)
        if lead < 0:
            raise GraphError(f"geir.grad: cannot sum a cotangent of shape {list(out)} to {list(target)}")
        axes = list(range(lead))
        undecided = []
        for i, dim in enumerate(target):
            have = out[lead + i]
            if dim == have or (isinstance(dim, str) and isinstance(have, str)
                               and self.forward.symbols.canonical(dim) == self.forward.symbols.canonical(have)):
                continue
            if dim == 1:
                axes.append(lead + i)
            elif isinstance(dim, int) and isinstance(have, int):
                raise GraphError(f"geir.grad: cannot sum a cotangent of shape {list(out)} to {list(target)}: dim "
                                 f"{i} is {dim} against {have}")
            else:
                undecided.append(i)
        if undecided:
            grad = self.op("ReduceSum", grad, self._broadcast_axes(grad, like, axes, undecided, lead), keepdims=1,
                           noop_with_empty_axes=1)
            return self.op("Reshape", grad, self.op("Shape", like))
        if axes:
            grad = self.op("ReduceSum", grad, self.ints(axes), keepdims=1)
        if lead:
            grad = self.op("Reshape", grad, self.shape_of(like))
        return grad

    def _broadcast_axes(self, grad: Value, like: Value, known: list[int], undecided: list[int], lead: int) -> Value:
        """The axes of ``grad`` that ``like`` was broadcast along: ``known`` ones, and those of ``undecided`` (dims of
        ``like``) where, at run time, ``like``'s size is 1 and the cotangent's is not."""
        picked = self.ints(undecided)
        target = self.op("Gather", self.op("Shape", like), picked)
        have = self.op("Gather", self.op("Shape", grad), self.ints([lead + i for i in undecided]))
        one = self.ints([1])
        broadcast = self.op("And", self.op("Equal", target, one), self.op("Not", self.op("Equal", have, one)))
        decided = self.op("Compress", self.ints([lead + i for i in undecided]), broadcast, axis=0)
        return self.op("Concat", self.ints(known), decided, axis=0) if known else decided


def _floating(value: Value) -> bool:
    return value.type.dtype.is_floating


def _select(graph: Graph, names: Sequence[str] | str | None, pool: list[Value], what: str) -> list[Value]:
    by_name = {v.name: v for v in pool}
    if names is None:
        return [v for v in pool if _floating(v)]
    if isinstance(names, str):
        names = [names]
    chosen = []
    for name in names:
        value = by_name.get(name)
        if value is None:
            raise GraphError(f"geir.grad: graph '{graph.name}' has no {what} {name!r} ({what}s: {sorted(by_name)})")
        if not _floating(value):
            raise GraphError(f"geir.grad: {what} '{name}' is {value.type.dtype}, not floating: it has no gradient")
        chosen.append(value)
    return chosen


def _without_rule(op_type: str, domain: str) -> bool:
    return vjp_rule(op_type, domain) is None


def _expandable(order: list[Node], depends: set[int]) -> set[int]:
    """ids of the standard nodes on the way from the inputs differentiated that no rule covers and ONNX defines by a
    function body (``expand_functions``)."""
    return {id(node) for node in order if node.domain == "" and _without_rule(node.op_type, node.domain)
            and any(v is not None and id(v) in depends for v in node.inputs)
            and defines_by_body(node.op_type, node.version or OPSET, node.domain)}


def _dependents(graph: Graph, order: list[Node], sources: list[Value]) -> set[int]:
    """ids of the floating values that depend on any of ``sources``."""
    found = {id(v) for v in sources}
    for node in order:
        if any(v is not None and id(v) in found for v in node.inputs):
            found.update(id(v) for v in node.outputs if v is not None and _floating(v))
    return found


def _cotangent_names(graph: Graph, sources: list[Value], targets: list[Value]) -> list[str]:
    """The cotangent input of each output differentiated: ``grad_<output>``, unless that name is taken by a name of
    the graph or a gradient output ``grad_<input>``; it is then ``grad_<output>_cotangent`` (with ``_1``, ``_2``, ...
    while taken). That happens for a pass-through output (a graph input that is also an output): ``grad_x`` is the
    gradient of input x, and the cotangent of output x must have another name."""
    taken = {v.name for v in graph.inputs} | {v.name for v in graph.outputs} | {f"grad_{v.name}" for v in sources}
    names = []
    for v in targets:
        name = f"grad_{v.name}"
        if name in taken:
            name = unused_name(f"{name}_cotangent", taken)
        taken.add(name)
        names.append(name)
    return names


class Differentiate(Pass):
    """The pass form of ``differentiate``: its result is the derivative graph (a new graph, built); ``report`` the
    forms of the ops of ours it emitted."""

    requires = frozenset({"verified", "typed"})
    ensures = frozenset({"verified", "typed"})

    def __init__(self, wrt: Sequence[str] | str | None = None, outputs: Sequence[str] | str | None = None,
                 target: str | None = None) -> None:
        self.wrt = wrt
        self.outputs = outputs
        self.target = target
        self.report: GradReport | None = None

    def call(self, graph: Graph) -> PassResult:
        derivative, self.report = differentiate_for(graph, self.wrt, self.outputs, self.target)
        return PassResult(derivative, True)


def differentiate(graph: Graph, wrt: Sequence[str] | str | None = None,
                  outputs: Sequence[str] | str | None = None, target: str | None = None) -> Graph:
    """The reverse-mode derivative of ``graph`` (a new graph named ``<name>_grad``): forward outputs, then
    ``grad_<input>`` for each input of ``wrt``.

    Args:
        graph: a built geir graph.
        wrt: names of the floating inputs to differentiate with respect to (default: every floating input).
        outputs: names of the floating outputs that receive a cotangent input ``grad_<output>`` (default: every
            floating output; ``grad_<output>_cotangent`` where ``grad_<output>`` is a name taken already).
        target: a device (``schemas.targets.TARGETS``): the ops of ours the rules emit and it refuses are emitted
            in a form it has (``target_forms``); None: as the rules emit them.

    Raises:
        GraphError: the graph is not built, a name is unknown or not floating, an op on the way from ``wrt`` to
            ``outputs`` has no VJP rule (the message names it), a rule cannot handle the node, or the target is
            unknown (the message lists the known ones).
    """
    return differentiate_for(graph, wrt, outputs, target)[0]


def differentiate_for(graph: Graph, wrt: Sequence[str] | str | None = None,
                      outputs: Sequence[str] | str | None = None,
                      target: str | None = None) -> tuple[Graph, GradReport]:
    """``differentiate``, and the report of the forms the ops of ours it emitted have (``target_forms``)."""
    if target is not None:
        validate_target(target)
    derivative, forward = _derivative(graph, wrt, outputs)
    return for_target(derivative, target, lambda node: node.name not in forward)


def _derivative(graph: Graph, wrt: Sequence[str] | str | None,
                outputs: Sequence[str] | str | None) -> tuple[Graph, frozenset[str]]:
    """The derivative, and the names of its nodes that are the forward's (copied, or re-emitted by a rewrite)."""
    if not {"verified", "typed"} <= graph.properties:
        raise GraphError(f"geir.grad: graph '{graph.name}' is not built; call GraphBuilder.build() first")
    sources = _select(graph, wrt, graph.inputs, "input")
    targets = _select(graph, outputs, graph.outputs, "output")
    if not targets:
        raise GraphError(f"geir.grad: graph '{graph.name}' has no floating output to differentiate")
    order = graph.topological_order()
    depends = _dependents(graph, order, sources)
    expandable = _expandable(order, depends)
    if expandable:      # ops ONNX defines by a function body and no rule covers (Attention): written out first
        graph = expand_functions(graph, expandable, _without_rule)
        sources = _select(graph, [v.name for v in sources], graph.inputs, "input")
        targets = _select(graph, [v.name for v in targets], graph.outputs, "output")
        order = graph.topological_order()
        depends = _dependents(graph, order, sources)
    b = GraphEditor(f"{graph.name}_grad")
    ctx = VjpContext(b, graph)

    def rewrite(node: Node, inputs: list[Value | None]) -> tuple[Value | None, ...] | None:
        hook = vjp_rewrite(node.op_type, node.domain)   # attention returns its statistics in the copy
        return None if hook is None else hook(ctx, node, inputs)
    names = _cotangent_names(graph, sources, targets)
    interface = frozenset(names) | {f"grad_{v.name}" for v in sources}   # a constant of such a name is renamed
    ctx.mapping.update(b.copy_from(graph, rewrite, outputs=False, reserved=interface))
    cotangents = {id(v): b.input(names[i], v.type.dtype, v.type.shape) for i, v in enumerate(targets)}
    ctx.depends = depends
    for node in reversed(order):
        out_grads = [cotangents.get(id(v)) if v is not None else None for v in node.outputs]
        if all(g is None for g in out_grads) or not any(v is not None and id(v) in depends for v in node.inputs):
            continue
        rule = vjp_rule(node.op_type, node.domain)
        if rule is None:
            raise GraphError(f"geir.grad: no VJP rule for {node.op_type} '{node.name}' (on the way from the inputs "
                             f"differentiated to the outputs); ops with rules: {', '.join(vjp_ops())}",
                             node=node.name, location=node.location)
        try:
            in_grads = list(rule(ctx, node, out_grads))
        except GraphError:
            raise
        except Exception as exc:   # a rule that did not foresee this node: a GraphError naming it, not a traceback
            raise GraphError(f"geir.grad: the VJP rule of {node.op_type} '{node.name}' failed: {type(exc).__name__}: "
                             f"{exc}", node=node.name, location=node.location) from exc
        if len(in_grads) != len(node.inputs):
            raise GraphError(f"geir.grad: the VJP rule of {node.op_type} returned {len(in_grads)} cotangents for "
                             f"{len(node.inputs)} inputs", node=node.name)
        for i, (value, g) in enumerate(zip(node.inputs, in_grads)):
            if value is None or id(value) not in depends or g is ACCOUNTED:
                continue
            if g is None:   # never a silent zero: the input depends on what is differentiated
                raise GraphError(f"geir.grad: {node.op_type} '{node.name}': no cotangent for input {i} "
                                 f"'{node.schema.inputs[min(i, len(node.schema.inputs) - 1)].name}' (value "
                                 f"'{value.name}'), which depends on the inputs differentiated: the op is not "
                                 f"differentiated with respect to it", node=node.name, location=node.location)
            if g.type.dtype != value.type.dtype:
                raise GraphError(f"geir.grad: the VJP rule of {node.op_type} '{node.name}' gave input '{value.name}' a "
                                 f"{g.type.dtype} cotangent, expected {value.type.dtype}", node=node.name)
            previous = cotangents.get(id(value))
            cotangents[id(value)] = g if previous is None else ctx.op("Add", previous, g)
    for v in graph.outputs:
        b.output(ctx.new(v))
    taken = {v.name for v in graph.outputs} | {v.name for v in graph.inputs}
    exported: list[Value] = []
    for v in sources:
        name = f"grad_{v.name}"
        if name in taken:
            raise GraphError(f"geir.grad: the gradient output name '{name}' is taken in graph '{graph.name}'")
        g = cotangents.get(id(v))
        g = ctx.zeros_like(ctx.new(v)) if g is None else g
        if g.producer is None or any(g is ctx.new(o) for o in graph.outputs) or g in exported:
            g = ctx.op("Identity", g)
        b.output(g, name)
        exported.append(g)
    derivative = EliminateDeadCode()(build(b))[0]   # what the outputs differentiated do not need
    drop_unused_constants(derivative, "vjp_")
    return derivative, frozenset(n.name for n in graph.nodes)
