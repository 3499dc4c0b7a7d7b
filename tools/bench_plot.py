"""``geir bench --plot``: the table's ratios as a bar chart, each bar coloured by its own targets' verdicts.

``bars`` turns the measured rows into what is drawn (a pure function, tested without matplotlib); ``draw`` renders
them. A bar is a row's time per unit of work as a multiple of its case's baseline row (the table's "vs baseline");
each of the row's targets is a tick on its bar where the row would just meet it, whatever row the target is held
to (the fresh copy, PyTorch, a fixed number of microseconds over the bare call), converted to the same scale.
Bars are grouped by op, then by the geir runtime that ran them, the other implementations of the op last.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..ir._files import replacing
from ..runtimes import runtime_names
from .bench_rows import Measurement, Verdict
from .model_io import CommandError

__all__ = ["Bar", "bars", "draw", "pyplot"]

COLOURS = {"MET": "#55A868", "MISSED": "#C44E52", "no target": "#A0A0A0"}
PEERS = "other implementations"


@dataclass(frozen=True)
class Bar:
    """One drawn row: ``ratio`` on the chart's scale, each target's ``targets`` position on it, and ``status``: MET
    (every target met), MISSED (any missed, as the table says) or "no target"."""
    group: str
    label: str
    ratio: float
    targets: tuple[float, ...]
    status: str


def _runtime(name: str) -> tuple[str | None, str]:
    """The geir runtime a row's name says it ran on ("geir onnxruntime, caller buffers", "geir.run numpy, fused"),
    and the rest of the name; (None, name) for a row that names none."""
    found = re.match(r"geir(?:\.run)? (\w+)(?:, )?", name)
    if found is None or found.group(1) not in runtime_names():
        return None, name
    return found.group(1), name[found.end():]


def bars(rows: Iterable[tuple[Measurement, float, float | None, Sequence[Verdict]]]) -> list[Bar]:
    """The bars of measured rows, each given as (row, its seconds, its ratio to the case's baseline or None, its
    verdicts): every row with a ratio except the baselines themselves, grouped by op (in the order the ops ran),
    within an op by runtime (in ``runtime_names`` order, the other implementations last; an op whose rows all fall
    in one group is a group of its own name), in the order they ran within a group."""
    order = {name: i for i, name in enumerate(runtime_names())}
    ops: dict[str, list[tuple[int, str, Bar]]] = {}
    for m, seconds, ratio, judged in rows:
        if ratio is None or m.baseline:
            continue
        runtime, rest = _runtime(m.name)
        status = "no target" if not judged else "MET" if all(v.met for v in judged) else "MISSED"
        rank = order.get(runtime, len(order)) if runtime is not None else len(order)
        group = f"geir {runtime}" if runtime is not None else PEERS
        label = f"{m.case} · {rest}" if rest else m.case
        targets = tuple(ratio * v.limit_s / seconds for v in judged)
        ops.setdefault(m.op, []).append((rank, group, Bar(group, label, ratio, targets, status)))
    drawn = []
    for op, members in ops.items():
        alone = len({group for _, group, _ in members}) == 1
        for _, group, bar in sorted(members, key=lambda member: member[0]):      # stable: run order within a group
            drawn.append(Bar(op if alone else f"{op} · {group}", bar.label, bar.ratio, bar.targets, bar.status))
    return drawn


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandError("--plot needs matplotlib: pip install matplotlib (or pip install -e \".[plot]\")") from None
    return plt


SLOT_IN = 0.24
"""Height of one bar (or group heading) in inches: 8-point labels, readable at the default 120 dpi."""


def draw(path: str, drawn: Sequence[Bar]) -> None:
    """A horizontal bar per row on a log scale, a bold heading per group, the row's targets as black ticks; the
    PNG replaces ``path`` whole or not at all."""
    plt = pyplot()
    slots: list[tuple[str, Bar | None]] = []          # (tick label, bar or None for a group's heading)
    for bar in drawn:
        if not slots or slots[-1][1] is None or slots[-1][1].group != bar.group:
            slots.append((bar.group, None))
        slots.append((bar.label, bar))
    fig, ax = plt.subplots(figsize=(12, 1.6 + SLOT_IN * max(1, len(slots))))
    try:
        _plot(ax, slots)
        fig.tight_layout()
        with replacing(path) as f:                  # the whole picture or the file as it was
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)


def _plot(ax: Any, slots: list[tuple[str, Bar | None]]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ys = range(len(slots))
    shown = [bar for _, bar in slots if bar is not None]
    for y, (_, bar) in zip(ys, slots):
        if bar is None:
            if y:
                ax.axhline(y - 0.5, color="#404040", linewidth=0.6)
            continue
        ax.barh(y, bar.ratio, height=0.7, color=COLOURS[bar.status])
        near = [t for t in bar.targets if bar.ratio <= t <= bar.ratio * 1.6]     # keep the number clear of a tick
        ax.text(max([bar.ratio, *near]) * 1.05, y, f"{bar.ratio:.2f}x", va="center", fontsize=7)
        for target in bar.targets:
            ax.plot([target], [y], marker="|", markersize=14, markeredgewidth=2.2, color="black", linestyle="none")
    ax.set_yticks(list(ys), [label for label, _ in slots], fontsize=8)
    for tick, (_, bar) in zip(ax.get_yticklabels(), slots):
        if bar is None:
            tick.set_fontweight("bold")
            tick.set_fontsize(9)
    ax.set_ylim(len(slots) - 0.5, -0.5)
    ax.set_xscale("log")
    values = [v for bar in shown for v in (bar.ratio, *bar.targets) if v > 0] or [1.0]
    low, high = min(min(values), 1.0) / 1.5, max(max(values), 1.0) * 2.0
    ax.set_xlim(low, high)
    steps = [m * 10.0 ** e for e in range(-6, 7) for m in (1, 2, 5) if low <= m * 10.0 ** e <= high]
    ax.xaxis.set_major_locator(FixedLocator(steps))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.grid(axis="x", which="major", color="#D8D8D8", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlabel("time per unit of work as a multiple of the case's baseline row: lower is faster\n(the baseline: a "
                  "copy of the same bytes, the float32 matmul, the bare call)", fontsize=9)
    handles = [Patch(color=COLOURS[s], label=f"{s}" + (" (every target)" if s == "MET" else " (a target)" if
                                                       s == "MISSED" else "")) for s in COLOURS]
    handles.append(Line2D([], [], marker="|", markersize=12, markeredgewidth=2.2, color="black", linestyle="none",
                          label="the row's own target"))
    handles.append(Line2D([], [], color="black", linewidth=0.8, label="1x: the baseline"))
    ax.legend(handles=handles, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles),
              frameon=False)
    ax.set_title("geir bench: each row against its case's baseline, coloured by its own targets", fontsize=10,
                 pad=22)
