"""The build pipeline: what turns an edited graph into a built one (verified, every type inferred)."""

from __future__ import annotations

from ..ir._core import Graph
from ..ir._editor import GraphEditor
from ._infra import PassManager
from .infer_shapes import InferShapes
from .verify import FillDefaults, VerifyGraph

__all__ = ["build", "build_pipeline"]


def build_pipeline() -> PassManager:
    """What ``GraphBuilder.build`` runs: attribute defaults, structural verification, then inference and
    semantic rules."""
    return PassManager([FillDefaults(), VerifyGraph(), InferShapes()])


def build(editor: GraphEditor) -> Graph:
    """Close ``editor`` and return its graph built (raises GraphError): the passes that emit a graph end so."""
    graph, _ = build_pipeline()(editor.finish())
    return graph
