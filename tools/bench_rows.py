"""One row of ``geir bench``: what is timed, how much work it does, and the targets it is held to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Measurement", "Verdict", "verdicts"]


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
    interleaved: bool = False
    """Timed together with the other interleaved rows of its op and case, a batch of each in turn per round, best per
    row (``bench.interleaved_best``): rows whose difference is the point (a call and the kernel it wraps,
    microseconds apart) are then timed under the same conditions. Timed one after another, seconds apart, on a
    machine whose speed drifts (a pure-Python loop here: 34 to 52 us within two seconds), two rows can differ by
    more than that. Not with ``also`` (its alternatives would be timed apart again)."""
    also: tuple[tuple[Callable[[], Callable[[], object]], float], ...] = ()
    """Other ways to do the same work: (a factory of the call, the work it does); each is made, timed and let go
    of in turn, and the row keeps the lowest time per unit of work, stated for its own ``work``."""

    def __post_init__(self) -> None:
        if self.interleaved and self.also:
            raise ValueError(f"bench row {self.case!r} / {self.name!r}: an interleaved row cannot have 'also' calls")


@dataclass(frozen=True)
class Verdict:
    """One stated target of a row, judged: the table prints ``text``, the plot colours the bar by ``met`` and marks
    ``limit_s``, the longest the row may take and still meet it (in its own seconds, comparable with its time)."""
    met: bool
    text: str
    limit_s: float


def verdicts(m: Measurement, t: float, cost: dict[tuple[str, str], float], torch_t: float | None,
             seconds: dict[tuple[str, str], float]) -> list[Verdict]:
    """Each stated target of the row ``m`` that took ``t`` seconds: at most X times its baseline row's time per unit
    of work (so '>= 50 % of the matmul's FLOP rate' is '<= 2x its time per flop'), at most S seconds over its
    baseline row's time (a fixed cost per call), and faster than PyTorch. ``cost`` and ``seconds`` hold each row's
    time per unit of work and time by (case, row name); a target whose baseline row did not run is left out."""
    judged = []
    for baseline, limit in m.targets:
        base = cost.get((m.case, baseline))
        if base is not None:
            multiple = t / m.work / base
            judged.append(Verdict(multiple <= limit, f"{'MET' if multiple <= limit else 'MISSED'} <= {limit:.3g}x "
                                  f"{baseline} ({multiple:.2f}x)", limit * base * m.work))
    for baseline, limit in m.overheads:
        base_t = seconds.get((m.case, baseline))
        if base_t is not None:
            extra = t - base_t
            judged.append(Verdict(extra <= limit, f"{'MET' if extra <= limit else 'MISSED'} <= {limit * 1e6:.3g} us "
                                  f"over {baseline} ({extra * 1e6:+.1f} us)", base_t + limit))
    if m.beat_torch and torch_t is not None:
        judged.append(Verdict(t < torch_t, f"{'MET' if t < torch_t else 'MISSED'} faster than PyTorch eager "
                              f"({t / torch_t:.2f}x)", torch_t))
    return judged
