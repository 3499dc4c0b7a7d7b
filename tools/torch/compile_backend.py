"""A ``torch.compile`` backend that runs the model as a geir graph: the CPU counterpart of torchair.

``torch.compile(model, backend=geir.torch.backend(target="ascend910b", runtime="onnxruntime"))``. Dynamo hands the
backend an FX graph; AOTAutograd splits it into a forward and a backward graph (aten ops and geir.torch's ops);
each is exported by torch's dynamo ONNX exporter with geir.torch's translation table (``onnx_export.py``: geir's ops
become ``ai.cann`` nodes), imported as a geir graph (every node verified by its schema), fused (``geir.fuse``
turns standard-op subgraphs into the CANN ops they compute), checked against ``target`` (``geir.check``) and
compiled once for the geir runtime. Each call then feeds the tensors to that executable and returns tensors.

What the backend did is kept in ``backend.reports``: per graph, the fused geir graph, the fusion report, the
target's check report and the CANN ops the graph now uses. A graph the target refuses raises ``GraphError``
naming the rules, or, with ``fallback=True``, runs eagerly (the AOT graph, as PyTorch would) with a warning saying
why; so does a graph geir cannot take (an op with no ONNX translation, dynamic shapes).
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ...ir._core import CANN_DOMAIN, Graph
from ...ir._errors import GeirWarning, GraphError
from ...passes.check_target import CheckReport
from ...runtimes._protocol import get_runtime
from ...schemas.targets import validate_target
from ..facade import check, fuse
from ..onnx_import import from_onnx
from ._bridge import to_numpy, to_torch
from .onnx_export import functional_rotary, onnx_translation_table, quiet_exporter

__all__ = ["CompiledGraph", "GeirBackend", "backend"]


@dataclass
class CompiledGraph:
    """What the backend made of one graph AOTAutograd handed it."""

    kind: str
    """"forward", "backward" or "inference"."""
    graph: Graph | None = None
    """The fused geir graph that runs (None when the graph fell back before it was built)."""
    fusion: Any = None
    """``geir.fuse``'s FusionReport: each match and near miss."""
    check: CheckReport | None = None
    """The target's report (None without a target)."""
    cann_ops: dict[str, int] = field(default_factory=dict)
    """The CANN ops (``ai.cann`` nodes) the fused graph uses, with their counts."""
    fallback: str | None = None
    """Why this graph runs eagerly instead (``fallback=True`` only); None when geir runs it."""

    def __str__(self) -> str:
        if self.fallback is not None:
            return f"{self.kind}: eager (fallback: {self.fallback})"
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(self.cann_ops.items())) or "none"
        verdict = "" if self.check is None else f"; {self.check.target}: {'ok' if self.check.ok else 'refused'}"
        return f"{self.kind}: {len(self.graph.nodes) if self.graph else 0} nodes, CANN ops: {ops}{verdict}"


class GeirBackend:
    """The backend object ``backend()`` returns; call ``torch.compile(model, backend=it)``."""

    def __init__(self, target: str | None = None, runtime: str = "numpy", *, fallback: bool = False,
                 allow_stricter_data: bool = False) -> None:
        self.target = None if target is None else validate_target(target)
        get_runtime(runtime)   # an unknown runtime fails here, not at the first compiled call
        self.runtime = runtime
        self.fallback = fallback
        self.allow_stricter_data = allow_stricter_data
        self.reports: list[CompiledGraph] = []
        self._aot = aot_autograd(fw_compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"),
                                 inference_compiler=self._compiler("inference"),
                                 decompositions=core_aten_decompositions())   # backward ops ONNX has (silu_backward)

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._aot(graph_module, example_inputs)

    def _compiler(self, kind: str) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
        def compile_graph(graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            report = CompiledGraph(kind)
            self.reports.append(report)
            try:   # on a copy: the fallback runs the graph exactly as AOTAutograd handed it
                work = torch.fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph))
                return self._compile(work, example_inputs, report)
            except GraphError as exc:
                if not self.fallback:
                    raise
                report.fallback = exc.message if hasattr(exc, "message") else str(exc)
                warnings.warn(f"geir.torch.backend: the {kind} graph runs eagerly: {report.fallback}", GeirWarning,
                              stacklevel=2)
                return _boxed(graph_module.forward)
        return compile_graph

    def _compile(self, graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 report: CompiledGraph) -> Callable[..., Any]:
        dynamic = [i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor)]
        if dynamic or any(not isinstance(d, int) for x in example_inputs for d in x.shape):
            raise GraphError(f"geir.torch.backend: the {report.kind} graph has dynamic sizes (inputs {dynamic or '?'}); "
                             "geir compiles static shapes: torch.compile(..., dynamic=False)")
        if functional_rotary(graph_module.graph) + _widen_bfloat16_selection(graph_module.graph):
            graph_module.recompile()
        total = len(_outputs_of(graph_module))
        kept = _drop_none_outputs(graph_module)
        model = _export(graph_module, example_inputs, report.kind)
        graph = from_onnx(model)
        if len(graph.inputs) != len(example_inputs) or len(graph.outputs) != len(kept):
            raise GraphError(f"geir.torch.backend: the exported {report.kind} graph has {len(graph.inputs)} inputs "
                             f"and {len(graph.outputs)} outputs, expected {len(example_inputs)} and {len(kept)}")
        fused, report.fusion = fuse(graph, allow_stricter_data=self.allow_stricter_data)
        report.graph = fused
        report.cann_ops = dict(Counter(n.op_type for n in fused.nodes if n.domain == CANN_DOMAIN))
        if self.target is not None:
            report.check = check(fused, self.target)
            if not report.check.ok:
                raise GraphError(f"geir.torch.backend: {self.target} refuses the {report.kind} graph "
                                 f"({', '.join(sorted(report.check.rules()))}):\n{report.check}")
        executable = get_runtime(self.runtime).compile(fused)
        return _boxed(_Runner(executable, [v.name for v in fused.inputs], [v.name for v in fused.outputs], kept,
                              total))


class _Runner:
    """One compiled graph: tensors in, the geir executable, tensors out (None where AOT's graph returns None)."""

    def __init__(self, executable: Any, inputs: list[str], outputs: list[str], kept: list[int], total: int) -> None:
        self.executable, self.inputs, self.outputs, self.kept, self.total = executable, inputs, outputs, kept, total

    def __call__(self, *args: Any) -> list[torch.Tensor | None]:
        arrays = [to_numpy(a, name) for a, name in zip(args, self.inputs)]
        results = self.executable.run(dict(zip(self.inputs, arrays)))
        values: list[torch.Tensor | None] = [None] * self.total
        for position, name in zip(self.kept, self.outputs):
            array = results[name]
            if (not array.flags.writeable or not array.flags.c_contiguous
                    or any(np.may_share_memory(array, a) for a in arrays)):
                array = array.copy()   # an output is never an input's memory, as a compiled graph's never is
            values[position] = to_torch(array)
        return values


_SELECTIONS = ("topk", "sort")
"""aten ops whose ONNX form (TopK) takes no bfloat16 before opset 24, newer than any torch exports (23): they
select elements without arithmetic, so in float32 (an exact widening) they give the same values and order."""


def _widen_bfloat16_selection(graph: torch.fx.Graph) -> int:
    """Run each bfloat16 ``topk``/``sort`` on the input widened to float32 and narrow its values back; return how
    many. Without it torch's exporter writes a TopK on bfloat16 that ONNX's own checker refuses."""
    count = 0
    for node in list(graph.nodes):
        overload = node.target
        if node.op != "call_function" or getattr(overload, "_opname", None) not in _SELECTIONS \
                or getattr(overload, "namespace", None) != "aten":
            continue
        value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if value is None or value.dtype != torch.bfloat16:
            continue
        with graph.inserting_before(node):
            wide = graph.call_function(torch.ops.aten._to_copy.default, (node.args[0],), {"dtype": torch.float32})
        node.args = (wide, *node.args[1:])
        for user in list(node.users):
            if user.op == "call_function" and user.args[1] == 0:   # the values; index 1, the indices, is unchanged
                with graph.inserting_after(user):
                    narrow = graph.call_function(torch.ops.aten._to_copy.default, (user,),
                                                 {"dtype": torch.bfloat16})
                user.replace_all_uses_with(narrow, delete_user_cb=lambda use: use is not narrow)
        count += 1
    return count


def _boxed(function: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    """``function`` in AOTAutograd's boxed calling convention (one list of arguments, marked ``_boxed_call``)."""
    def call(args: list[Any]) -> Any:
        return function(*args)
    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _outputs_of(graph_module: torch.fx.GraphModule) -> list[Any]:
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    result = output.args[0]
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _drop_none_outputs(graph_module: torch.fx.GraphModule) -> list[int]:
    """Remove the graph's None outputs (the backward's gradients of non-differentiable inputs), which ONNX cannot
    hold; return the positions of the outputs kept."""
    outputs = _outputs_of(graph_module)
    kept = [i for i, value in enumerate(outputs) if value is not None]
    if len(kept) != len(outputs):
        output = next(n for n in graph_module.graph.nodes if n.op == "output")
        output.args = (tuple(outputs[i] for i in kept),)
        graph_module.recompile()
    return kept


def _export(graph_module: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], kind: str) -> Any:
    """The graph as an ONNX model (torch's dynamo exporter, geir.torch's translation table)."""
    with unset_fake_temporarily(), quiet_exporter():
        args = tuple(torch.zeros(x.shape, dtype=x.dtype) for x in example_inputs)
        try:
            program = torch.onnx.export(graph_module, args, dynamo=True, verbose=False,
                                        custom_translation_table=onnx_translation_table())
        except Exception as exc:   # the exporter raises its own error types for ops it cannot translate
            raise GraphError(f"geir.torch.backend: torch's ONNX exporter cannot export the {kind} graph: "
                             f"{type(exc).__name__}: {_summary(exc)}") from exc
    if program is None:   # pragma: no cover - the dynamo exporter always returns a program
        raise GraphError(f"geir.torch.backend: torch's ONNX exporter returned nothing for the {kind} graph")
    return program.model_proto


def _summary(exc: Exception) -> str:
    text = str(exc)
    marker = "## Exception summary"
    if marker in text:
        text = text.split(marker, 1)[1]
    return " ".join(text.split())[:600]


def backend(target: str | None = None, runtime: str = "numpy", *, fallback: bool = False,
            allow_stricter_data: bool = False) -> GeirBackend:
    """A ``torch.compile`` backend running the model's forward and backward graphs as geir graphs.

    ``target``: check each graph against this device (``geir.check``) and refuse it if the device would;
    ``runtime``: "numpy" or "onnxruntime"; ``fallback``: run a graph geir refuses eagerly, with a warning, instead
    of raising; ``allow_stricter_data``: passed to ``geir.fuse``. Compile with ``dynamic=False``."""
    return GeirBackend(target, runtime, fallback=fallback, allow_stricter_data=allow_stricter_data)
