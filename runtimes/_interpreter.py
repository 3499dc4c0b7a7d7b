"""The machinery of any runtime that interprets a graph node by node, written once.

A subclass says which callable runs a node (``resolve``); this module does the rest, as
torch.fx's Interpreter does: a schedule of the live nodes with each value's last use (buffers
die early), the fed-shape re-checks of nodes whose types hold symbols, the run-time data rules,
ownership by provenance (what may be written in place), the check of what a kernel returned,
and the wrapping of kernel failures with the node that failed. It knows no array library: a subclass also
names its ``backend`` (``runtimes._arrays.ArrayBackend``), which answers every question the core asks of an
array (its dtype, whether it shares memory with another, how to copy it).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..ir._core import Graph, Node, Value
from ..ir._errors import ExecutionError, GraphError
from ..ir._types import TensorType
from ..passes import live_nodes

from ._arrays import Array, ArrayBackend
from ._checks import describe, is_symbolic, output_types_on, validate_node_data
from ._compiled import ensure_built, ensure_current
from ._feeds import validate_feeds
from ._outputs import fill_output_buffers, validate_output_buffers

__all__ = ["InterpretedExecutable", "NodeKernel"]

NodeKernel = Callable[..., Any]
"""``kernel(*inputs, **attributes[, out=buffer]) -> array | tuple of arrays``."""


class _Step:
    """One scheduled node with everything its run needs that does not depend on the feeds, worked out once at
    compile time (a run then costs a few lookups per node, not a schema lookup and a signature per node)."""

    __slots__ = ("node", "kernel", "ours", "attributes", "inputs", "outputs", "aliased", "takes_outputs",
                 "validates", "symbolic", "types", "release", "reusable")

    def __init__(self, executable: InterpretedExecutable, step: int, node: Node) -> None:
        self.node = node
        self.kernel, self.ours = executable.kernels[node]
        self.attributes = dict(node.attributes)      # as compiled: the run follows the graph it was compiled from
        self.inputs = tuple(None if v is None else v.name for v in node.inputs)
        self.outputs = node.outputs
        self.aliased = node.schema.outputs[0].alias is not None and node.outputs[0] is not None
        self.takes_outputs = node in executable.writes_into
        self.validates = node.schema.validate is not None
        self.symbolic = node in executable.symbolic
        self.types: list[TensorType | None] = [None if v is None else v.type for v in node.outputs]
        last, outputs = executable.last_use, executable.outputs
        self.release = tuple(dict.fromkeys(v.name for v in node.inputs if v is not None and last[id(v)] == step
                                           and id(v) not in outputs))
        """Values read for the last time here (not graph outputs): dropped after the node, so their buffers die."""
        first = node.inputs[0] if node.inputs else None
        self.reusable = (self.aliased and first is not None and last[id(first)] == step and id(first) not in outputs
                         and sum(1 for v in node.inputs if v is first) == 1)
        """The aliased output may take input 0's buffer when the run owns it (this node is its last reader)."""


class InterpretedExecutable(ABC):
    """A verified graph scheduled for node-by-node execution.

    In-place: an aliased output may reuse its input's buffer only when the run created that
    buffer, this node is its last reader and it is not a graph output. Ownership is decided by
    provenance: an output of a kernel that ``resolve`` called *ours* and that shares no memory
    with the node's inputs, or the buffer the run itself handed in as ``out``. Never a feed, a
    constant, or anything a foreign kernel returns (onnx.reference may hand back its input
    object or a cached array).
    """

    runtime_name = "interpreter"
    backend: ClassVar[ArrayBackend[Any]]
    """The arrays this runtime's kernels take and return (the NumPy runtime: ``runtimes.numpy._arrays.NUMPY``)."""

    def __init__(self, graph: Graph) -> None:
        ensure_built(graph)
        self.graph = graph
        self.revision = graph.revision
        self.constants = {name: self.backend.from_host(array) for name, array in graph.constants.items()}
        """The graph's constants as the backend's arrays (read-only: never owned, so never written in place)."""
        live = live_nodes(graph)
        self.order: list[Node] = [n for n in graph.topological_order() if n in live]
        self.kernels: dict[Node, tuple[NodeKernel, bool]] = {}
        for node in self.order:
            resolved = self.resolve(node)
            if resolved is None:
                raise GraphError(f"runtime '{self.runtime_name}' has no kernel for {node.domain}::{node.op_type} "
                                 f"(node '{node.name}')", node=node.name, location=node.location)
            self.kernels[node] = resolved
        self.writes_into = {node for node in self.order if _takes_outputs(self.kernels[node][0])}
        """Nodes whose kernels write the caller's output buffers themselves (``outputs=``): no copy after."""
        self.outputs = {id(v) for v in graph.outputs}
        self.last_use: dict[int, int] = {}
        for step, node in enumerate(self.order):
            for value in node.inputs:
                if value is not None:
                    self.last_use[id(value)] = step
        self.symbolic = {n for n in self.order if is_symbolic(n) and all(
            v is None or v.type.is_tensor for v in list(n.inputs) + list(n.outputs))}
        """Nodes whose rules run again on the fed shapes (not those exchanging sequences or optionals: no shapes)."""
        self.steps = [_Step(self, step, node) for step, node in enumerate(self.order)]

    @abstractmethod
    def resolve(self, node: Node) -> tuple[NodeKernel, bool] | None:
        """The kernel that runs ``node`` and whether its fresh results are ours to own; None: no kernel."""

    def run(self, feeds: Mapping[str, object], outputs: Mapping[str, object] | None = None) -> dict[str, Array]:
        ensure_current(self.graph, self.revision, self.runtime_name)
        backend = self.backend
        env, bindings = validate_feeds(self.graph, feeds, backend)
        buffers = validate_output_buffers(self.graph, outputs, env, bindings, feeds, backend)
        env.update(self.constants)
        owned: set[str] = set()
        with backend.kernel_errstate():   # inf and NaN are IEEE results, as ONNX Runtime gives them silently
            for step in self.steps:
                self._run_step(step, env, buffers, owned)
        result = {}
        for value in self.graph.outputs:
            array = env[value.name]
            result[value.name] = array if value.name in owned or value.name in buffers else _copy(backend, array)
        fill_output_buffers(self.graph, result, buffers, backend)
        return result

    def _run_step(self, step: _Step, env: dict[str, Array], buffers: Mapping[str, Array], owned: set[str]) -> None:
        node = step.node
        args = [None if name is None else env[name] for name in step.inputs]
        expected = step.types if not step.symbolic else output_types_on(
            self.graph, node, [None if a is None else a.shape for a in args])   # re-checks the semantic rules
        if step.validates:
            validate_node_data(node, args, step.attributes, self.backend)
        kwargs = dict(step.attributes)
        reused = None
        if step.aliased and step.outputs[0].name in buffers:
            kwargs["out"] = buffers[step.outputs[0].name]          # the caller's buffer: written directly
        elif step.reusable and step.inputs[0] in owned:
            kwargs["out"] = reused = args[0]
        if step.takes_outputs and buffers:
            into = tuple(_buffer_for(value, want, buffers) for value, want in zip(step.outputs, expected))
            if any(b is not None for b in into):
                kwargs["outputs"] = into
        try:
            results = step.kernel(*args, **kwargs)
        except ExecutionError:
            raise
        except Exception as exc:
            raise ExecutionError(f"While executing {describe(node)}: {type(exc).__name__}: {exc}",
                                 node=node.name) from exc
        if not isinstance(results, tuple):
            results = (results,)
        backend = self.backend
        shares = backend.may_share_memory
        for value, array, want in zip(step.outputs, results, expected):
            if value is None:
                continue
            if not want.is_tensor:             # a sequence (a list) or an optional value (None when empty)
                _check_non_tensor(node, value.name, array, want, backend)
                env[value.name] = array
                continue
            if backend.dtype_of(array) is not want.dtype or not _shape_matches(array.shape, want.dims):
                raise ExecutionError(f"{describe(node)}: kernel returned {backend.dtype_name(array)}"
                                     f"{list(array.shape)} for output '{value.name}', expected {want}", node=node.name)
            env[value.name] = array
            if value.name in buffers:      # the caller's: never reused for a later in-place write
                continue
            if _allocated_here(step.ours, array, args, reused, shares):
                owned.add(value.name)
            else:   # a view of an owned input makes that input shared: no longer written in place
                owned.difference_update(name for name, a in zip(step.inputs, args)
                                        if name is not None and backend.is_array(a) and shares(array, a))
        for name in step.release:
            env.pop(name, None)


def _copy(backend: ArrayBackend[Any], value: Any) -> Any:
    """A copy of an output the run does not own: an array, a sequence's list of arrays, or None."""
    if value is None:
        return None
    return [backend.copy(a) for a in value] if isinstance(value, list) else backend.copy(value)


def _check_non_tensor(node: Node, name: str, value: Any, want: TensorType, backend: ArrayBackend[Any]) -> None:
    """What a kernel returned for a sequence or optional output is of that kind and element dtype."""
    if value is None and want.kind.startswith("optional"):
        return
    items = value if want.kind in ("sequence", "optional_sequence") and isinstance(value, list) else [value]
    if want.kind in ("sequence", "optional_sequence") and not isinstance(value, list) or any(
            not backend.is_array(a) or backend.dtype_of(a) is not want.dtype for a in items):
        raise ExecutionError(f"{describe(node)}: kernel returned {type(value).__name__} for output '{name}', "
                             f"expected {want}", node=node.name)


def _takes_outputs(kernel: NodeKernel) -> bool:
    try:
        return "outputs" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):   # a callable without a signature
        return False


def _buffer_for(value: Value | None, want: TensorType | None, buffers: Mapping[str, Array]) -> Array | None:
    """The caller's buffer for this node output, when it has one of the output's concrete shape."""
    buffer = buffers.get(value.name) if value is not None else None
    return buffer if buffer is not None and want is not None and _shape_matches(buffer.shape, want.dims) else None


def _allocated_here(ours: bool, array: Array, args: list[Array | None], reused: Array | None,
                    shares: Callable[[Array, Array], bool]) -> bool:
    """Whether this run owns ``array``: our kernel made it fresh, or it is the buffer we handed in."""
    if reused is not None and array is reused:
        return True
    return ours and not any(a is not None and not isinstance(a, list) and shares(array, a) for a in args)


def _shape_matches(actual: tuple[int, ...], declared: tuple | None) -> bool:
    """Ranks equal and every int dim equal (symbols of data-dependent standard-op outputs match any size; an
    unknown rank, None, any shape)."""
    return declared is None or len(actual) == len(declared) and all(not isinstance(d, int) or d == a
                                                                    for a, d in zip(actual, declared))
