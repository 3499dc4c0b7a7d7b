"""Graph passes of one framework (``_infra``: each states what it requires and ensures): verification,
inference, dead-code elimination, target checks, autodiff (``autodiff.Differentiate``) and fusion
(``fusion.Fuse``), the last two reached through ``geir.grad`` and ``geir.fuse``."""

from __future__ import annotations

from ._infra import Pass, PassManager, PassResult
from .check_target import CheckReport, CheckTarget, Violation
from .dead_code import EliminateDeadCode, live_nodes
from .infer_shapes import InferShapes, infer_node
from .verify import FillDefaults, VerifyGraph
from .build import build, build_pipeline

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
    "build",
    "build_pipeline",
    "infer_node",
    "live_nodes",
]

