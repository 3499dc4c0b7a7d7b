"""Graph passes: verification, inference, dead-code elimination, target checks, autodiff (``autodiff``) and
fusion (``fusion``), the last two reached through ``geir.grad`` and ``geir.fuse``."""

from __future__ import annotations

from ._infra import Pass, PassManager, PassResult
from .check_target import CheckReport, CheckTarget, Violation
from .dead_code import EliminateDeadCode, live_nodes
from .infer_shapes import InferShapes, infer_node
from .verify import FillDefaults, VerifyGraph

__all__ = [
    "CheckReport",
    "CheckTarget",
    "EliminateDeadCode",
    "FillDefaults",
    "InferShapes",
    "Pass",
    "PassManager",
    "PassResult",
    "VerifyGraph",
    "Violation",
    "build_pipeline",
    "infer_node",
    "live_nodes",
]


def build_pipeline() -> PassManager:
    """What ``GraphBuilder.build`` runs: attribute defaults, structural verification, then inference and
    semantic rules."""
    return PassManager([FillDefaults(), VerifyGraph(), InferShapes()])
