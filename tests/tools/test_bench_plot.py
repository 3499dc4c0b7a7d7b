"""``geir bench --plot`` (issue 30, item 3): each bar coloured by the verdicts the table prints, each row's own targets
marked on its scale, rows grouped by op and runtime; ``geir bench`` without suites runs every suite (None)."""

from __future__ import annotations

import pytest

from geir.tools import bench, bench_plot
from geir.tools.bench_rows import Measurement, verdicts
from geir.tools.cli import main


def _row(op: str, name: str, work: float = 1000.0, **kwargs) -> Measurement:
    return Measurement(op, "case", name, lambda: None, work, "GB/s", **kwargs)


def _judged(rows: list[tuple[Measurement, float]]):
    """(row, seconds, ratio, verdicts) as run_benchmarks computes them, the first row the case's baseline."""
    cost = {(m.case, m.name): t / m.work for m, t in rows}
    seconds = {(m.case, m.name): t for m, t in rows}
    torch_t = next((t for m, t in rows if m.name == "PyTorch eager"), None)
    base = rows[0][1] / rows[0][0].work
    return [(m, t, t / m.work / base, verdicts(m, t, cost, torch_t, seconds)) for m, t in rows]


def test_bars_colour_by_the_rows_own_verdicts_and_mark_each_target_on_the_baseline_scale():
    rows = [(_row("Rope", "warm copy", baseline=True), 1.0),
            (_row("Rope", "fresh copy"), 0.5),
            (_row("Rope", "geir onnxruntime", targets=(("fresh copy", 1.2),), beat_torch=True), 0.8),
            (_row("Rope", "geir onnxruntime, caller buffers", targets=(("warm copy", 1.3),)), 1.2),
            (_row("Rope", "geir numpy", targets=(("warm copy", 4.0),)), 3.0),
            (_row("Rope", "PyTorch eager"), 2.0),
            (_row("Rope", "geir numpy, caller buffers", overheads=(("warm copy", 0.5),)), 1.6)]
    drawn = bench_plot.bars(_judged(rows))
    by_label = {(b.group, b.label): b for b in drawn}
    assert [(b.group, b.label) for b in drawn] == [          # numpy before onnxruntime (runtime_names), peers last
        ("Rope · geir numpy", "case"), ("Rope · geir numpy", "case · caller buffers"),
        ("Rope · geir onnxruntime", "case"), ("Rope · geir onnxruntime", "case · caller buffers"),
        ("Rope · other implementations", "case · fresh copy"), ("Rope · other implementations", "case · PyTorch eager")]
    ort = by_label["Rope · geir onnxruntime", "case"]
    # 0.8 s against the fresh copy's 0.5 s is 1.6x > 1.2x (missed) though faster than PyTorch (met): MISSED, and
    # the ticks sit where the row would just meet each: 1.2 x 0.5 = 0.6 and PyTorch's 2.0, on the warm copy's scale
    assert ort.status == "MISSED" and ort.ratio == pytest.approx(0.8) and ort.targets == pytest.approx((0.6, 2.0))
    assert by_label["Rope · geir onnxruntime", "case · caller buffers"].status == "MET"   # 1.2 <= 1.3
    assert by_label["Rope · geir onnxruntime", "case · caller buffers"].targets == pytest.approx((1.3,))
    numpy = by_label["Rope · geir numpy", "case"]
    assert (numpy.status, numpy.targets) == ("MET", pytest.approx((4.0,)))
    overhead = by_label["Rope · geir numpy", "case · caller buffers"]   # 1.6 s <= 1.0 s + 0.5 s? no: missed at 1.5
    assert overhead.status == "MISSED" and overhead.targets == pytest.approx((1.5,))
    peers = [b for b in drawn if b.group.endswith("other implementations")]
    assert all(b.status == "no target" and b.targets == () for b in peers)
    assert "warm copy" not in {b.label.split(" · ")[-1] for b in drawn}        # the baseline is the scale, not a bar


def test_an_op_whose_rows_are_one_group_is_named_by_the_op_alone_and_ops_keep_their_order():
    rows = [(_row("geir.fuse", "10 ropes", baseline=True), 1.0), (_row("geir.fuse", "100 ropes"), 2.0)]
    other = [(_row("Moe", "copy", baseline=True), 1.0), (_row("Moe", "geir onnxruntime"), 1.0)]
    drawn = bench_plot.bars(_judged(rows) + _judged(other) + [(_row("Moe", "no baseline"), 1.0, None, [])])
    assert [(b.group, b.label, b.status) for b in drawn] == [("geir.fuse", "case · 100 ropes", "no target"),
                                                            ("Moe", "case", "no target")]


def test_the_plot_gets_the_verdicts_the_table_prints(monkeypatch):
    """run_benchmarks hands draw one bar per row with a ratio, each MET or MISSED exactly as its table line says."""
    rows = [Measurement("Op", "case", "copy", lambda: 0.002, 1000.0, "GB/s", baseline=True),   # seconds per call:
            Measurement("Op", "case", "geir numpy", lambda: 0.001, 1000.0, "GB/s", targets=(("copy", 1.5),)),
            Measurement("Op", "case", "geir onnxruntime", lambda: 0.008, 1000.0, "GB/s",   # best_time returns them
                        targets=(("copy", 1.5),))]
    drawn = []
    monkeypatch.setitem(bench.SUITES, "fake", lambda quick: rows)
    monkeypatch.setattr(bench, "best_time", lambda fn, repeat: fn())    # known times, not sleeps on a busy machine
    monkeypatch.setattr(bench, "pyplot", lambda: None)
    monkeypatch.setattr(bench, "draw", lambda path, bars: drawn.append((path, bars)))
    table = bench.run_benchmarks(["fake"], repeat=2, progress=None, plot="ratios.png")
    [(path, bars)] = drawn
    assert path == "ratios.png" and "plot: ratios.png" in table
    assert {b.group: b.status for b in bars} == {"Op · geir numpy": "MET", "Op · geir onnxruntime": "MISSED"}
    for bar in bars:
        name = bar.group.split(" · ")[1]
        [line] = [line for line in table.splitlines() if line.startswith("Op ") and f"  {name}  " in line]
        assert f"{bar.status} <= 1.5x copy" in line
        assert bar.targets == pytest.approx((1.5,))


def test_bench_without_suites_runs_every_suite(monkeypatch, capsys):
    """The command line says "all" with None (not a list that happens to equal SUITES), and None runs each suite."""
    asked = []
    monkeypatch.setattr(bench, "run_benchmarks", lambda names, **kwargs: asked.append(names) or "table")
    assert main(["bench", "--quick"]) == 0 and main(["bench", "moe", "--quick"]) == 0
    assert asked == [None, ["moe"]]
    ran = []
    monkeypatch.undo()
    monkeypatch.setattr(bench, "SUITES", {name: (lambda quick, name=name: ran.append(name) or []) for name in "ab"})
    bench.run_benchmarks(None, progress=None)
    assert ran == ["a", "b"]


def test_the_plot_renders_groups_targets_and_legible_labels(tmp_path):
    pytest.importorskip("matplotlib", reason="the drawing needs the optional matplotlib (pip install -e '.[plot]')")
    rows = [(_row("Rope", "warm copy", baseline=True), 1.0), (_row("Rope", "fresh copy"), 0.5),
            (_row("Rope", "geir onnxruntime", targets=(("fresh copy", 1.2),)), 0.8),
            (_row("Rope", "geir numpy", targets=(("warm copy", 4.0),)), 3.0)]
    drawn = bench_plot.bars(_judged(rows))
    picture = tmp_path / "ratios.png"
    bench_plot.draw(str(picture), drawn)
    from matplotlib.image import imread

    image = imread(str(picture))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = image.shape[:2]
    slots = len(drawn) + len({b.group for b in drawn})
    assert width == 12 * 120 and abs(height - (1.6 + bench_plot.SLOT_IN * slots) * 120) <= 1   # a slot per line
    colours = {tuple(round(c * 255) for c in pixel[:3]) for pixel in image.reshape(-1, image.shape[-1])}
    for status in ("MET", "MISSED", "no target"):
        hex_colour = bench_plot.COLOURS[status]
        assert tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)) in colours, status
