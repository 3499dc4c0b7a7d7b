"""Top-level functions of the facade: run a graph, check it for a target."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Literal, overload

import numpy as np
from onnx import ModelProto

from ..ir._core import Graph
from ..ir._editor import GraphEditor
from ..ir._errors import GraphError
from ..passes import CheckReport, CheckTarget, build
from ..passes.autodiff import differentiate_for
from ..passes.target_forms import GradReport
from ..passes.fusion import Fuse, FusionReport
from ..runtimes import get_runtime
from . import model_cache

__all__ = ["as_graph", "check", "fuse", "grad", "run"]

GraphLike = Graph | ModelProto | str | os.PathLike


def as_graph(graph: GraphLike, caller: str) -> Graph:
    """A built geir Graph from a Graph, an ONNX ModelProto or the path of an ONNX file."""
    if isinstance(graph, Graph):
        return graph
    if isinstance(graph, (ModelProto, str, os.PathLike)):
        return model_cache.imported(graph)
    raise GraphError(f"{caller}: expected a geir Graph, an onnx.ModelProto or the path of an ONNX file, got "
                     f"{type(graph).__name__}")


def run(graph: GraphLike, feeds: Mapping[str, np.ndarray], runtime: str = "numpy",
        outputs: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Compile ``graph`` for ``runtime`` and run it once; return the outputs by name.

    ``graph`` may also be an ONNX ModelProto or file path (imported with ``from_onnx``). ``outputs``
    gives caller-provided buffers by output name, which the run writes (and returns) instead of
    allocating: writeable, C-contiguous, of the output's dtype and shape.

    Raises:
        ExecutionError: a feed is missing, unexpected or of the wrong dtype/shape, or a
            node's input data is invalid; the message names the input or node.
    """
    return get_runtime(runtime).compile(as_graph(graph, "geir.run")).run(feeds, outputs)


def check(graph: GraphLike, target: str, strict: bool = False) -> CheckReport:
    """Check a built graph (or an ONNX model or file) against one device's restrictions; return a ``CheckReport``.

    ``report.ok`` is False when a rule of level ``error`` is broken (the device refuses the graph); with
    ``strict``, also for ``unsupported`` (what the docs forbid but the device code accepts).
    Raises GraphError for an unknown target (the message lists the known ones).
    """
    check_pass = CheckTarget(target, strict)
    check_pass(as_graph(graph, "geir.check"))
    return check_pass.report


@overload
def grad(graph: GraphLike, wrt: Sequence[str] | str | None = None, outputs: Sequence[str] | str | None = None, *,
         target: str | None = None, report: Literal[False] = False) -> Graph: ...


@overload
def grad(graph: GraphLike, wrt: Sequence[str] | str | None = None, outputs: Sequence[str] | str | None = None, *,
         target: str | None = None, report: Literal[True]) -> tuple[Graph, GradReport]: ...


def grad(graph: GraphLike, wrt: Sequence[str] | str | None = None, outputs: Sequence[str] | str | None = None, *,
         target: str | None = None, report: bool = False) -> Graph | tuple[Graph, GradReport]:
    """Reverse-mode derivative of a built graph (or an ONNX model or file), as a new graph.

    Its inputs are the graph's inputs plus ``grad_<output>`` (the cotangent) for each output differentiated
    (``outputs``, default: every floating output); its outputs are the graph's outputs followed by
    ``grad_<input>`` for each input of ``wrt`` (default: every floating input). Our ops become their CANN
    gradient ops (SparseFlashAttention is rewritten to return the softmax statistics its grad reads).

    With ``target`` (a device, as for ``check``), an op the derivative adds that the device refuses (e.g.
    InplacePartialRotaryMulGrad on ascend910b/ascend910_93, RP-T1) is emitted in a form it has instead: ops of
    ours that compute the same bits where that is proven (the rotary grad as the forward with negated sin, for
    pair-duplicated tables), else the op's standard-op body. ``check(derivative, target)`` then finds only what it
    finds in the forward. With ``report=True``, the result is ``(derivative, GradReport)``: the form of each op
    of ours the derivative added, and why.

    Raises:
        GraphError: an unknown or non-floating name, an op on the way without a VJP rule (named), or an unknown
            target (the message lists the known ones).
    """
    derivative, forms = differentiate_for(as_graph(graph, "geir.grad"), wrt, outputs, target)
    return (derivative, forms) if report else derivative


def fuse(graph: GraphLike, *, allow_stricter_data: bool = False) -> tuple[Graph, FusionReport]:
    """Rewrite standard-op subgraphs that are one of our ops into that op; return the new graph and a report.

    The graph's interface is kept (inputs, outputs, names, types); ``graph`` itself is not changed. The report
    lists each match (pattern, nodes replaced, the op it became) and each near miss with its reason; a match
    whose op refuses it (a schema rule) is a near miss too. See ``schemas/<family>/fusion.py`` for the patterns.

    A rewrite holds for every input the graph accepts, or it does not fire. Where our op checks data the
    subgraph does not (attention's key ids distinct per row, MoE indices a permutation) and that data is not a
    constant, the match is a near miss unless ``allow_stricter_data=True``: then it fuses, and such data is
    refused with an ``ExecutionError`` when the fused graph runs (never computed into another result).
    """
    fusion = Fuse(allow_stricter_data=allow_stricter_data)
    fused, _ = fusion(build(GraphEditor.copy(as_graph(graph, "geir.fuse"))))
    return fused, fusion.report
