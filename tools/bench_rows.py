"""One row of ``geir bench``: what is timed, how much work it does, and the targets it is held to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Measurement"]


@dataclass
class Measurement:
    op: str
    case: str
    name: str
    fn: Callable[[], object]
    work: float                     # bytes moved or flops
    unit: str                       # "GB/s" or "GFLOP/s"
    baseline: bool = False
    targets: tuple[tuple[str, float], ...] = ()
    """(baseline row of the same case, the most this row may cost as a multiple of that row's time)."""
    overheads: tuple[tuple[str, float], ...] = ()
    """(baseline row of the same case, the most seconds this row may take beyond that row's time): a fixed cost per
    call, which a ratio cannot state for calls that do almost nothing."""
    beat_torch: bool = False
    also: tuple[tuple[Callable[[], Callable[[], object]], float], ...] = ()
    """Other ways to do the same work: (a factory of the call, the work it does); each is made, timed and let go
    of in turn, and the row keeps the lowest time per unit of work, stated for its own ``work``."""
