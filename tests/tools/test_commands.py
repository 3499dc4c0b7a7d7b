"""``geir run``, ``check``, ``show``, ``example``, ``--version`` and ``python -m geir``: end to end in a subprocess
on saved models (outputs compared with ``geir.run``), and every bad path, feed and target."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import geir
from geir.schemas.targets import TARGETS
from geir.tools.cli import main
from moe.helpers import moe_graph
from rotary.helpers import ROPE_GRAD, rotary_graph

ROOT = Path(__file__).parents[2]


def _geir(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "geir", *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def rope_model(tmp_path):
    graph = rotary_graph(ROPE_GRAD, ("B", 4, 2, 16), (1, 4, 1, 8), "bfloat16", "float32", rotary_mode=1,
                         partial_slice=[4, 12])
    path = tmp_path / "rope_grad.onnx"
    geir.save_onnx(graph, str(path))
    return graph, path


def test_version_help_and_python_dash_m():
    result = _geir("--version")
    assert result.returncode == 0 and result.stdout.strip() == "geir 0.1.0"
    result = _geir("--help")
    assert result.returncode == 0
    for command in ("demo", "bench", "run", "check", "show", "example"):
        assert f"    {command}" in result.stdout, command


def test_run_writes_what_geir_run_computes(rope_model, tmp_path):
    graph, model = rope_model
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((3, 4, 2, 16)).astype(ml_dtypes.bfloat16),
             "cos": rng.standard_normal((1, 4, 1, 8)).astype(np.float32),
             "sin": rng.standard_normal((1, 4, 1, 8)).astype(np.float32)}
    np.savez(tmp_path / "feeds.npz", x=feeds["x"].astype(np.float32), cos=feeds["cos"])   # bfloat16 as exact float32
    np.save(tmp_path / "sin.npy", feeds["sin"])
    result = _geir("run", str(model), "--feeds", str(tmp_path / "feeds.npz"), "--input", f"sin={tmp_path / 'sin.npy'}",
                   "--output", str(tmp_path / "out.npz"), "--repeat", "3", "--runtime", "onnxruntime")
    assert result.returncode == 0, result.stderr
    assert "y  bfloat16  [3, 4, 2, 16]" in result.stdout and "3 runs: min" in result.stdout
    assert "bfloat16 stored as float32: y" in result.stdout
    want = geir.run(graph, feeds)["y"].astype(np.float32)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npz")["y"], want)


def test_run_random_feeds_take_symbolic_sizes_from_dim(rope_model):
    _, model = rope_model
    result = _geir("run", str(model), "--random", "--dim", "B=5")
    assert result.returncode == 0, result.stderr
    assert "[5, 4, 2, 16]" in result.stdout and "min " in result.stdout


@pytest.mark.parametrize("args, message", [
    (["run", "MISSING.onnx", "--random"], "geir run: model 'MISSING.onnx': no such file"),
    (["run", "{model}", "--random"], "input 'x' has the symbolic dim 'B': give its size with --dim B=SIZE"),
    (["run", "{model}"], "no feed for input(s) x, cos, sin: give --input NAME=FILE.npy, --feeds FILE.npz or --random"),
    (["run", "{model}", "--random", "--dim", "B"], "--dim 'B': expected NAME=VALUE"),
    (["run", "{model}", "--random", "--dim", "B=-1"], "--dim B=-1: expected a size >= 0"),
    (["run", "{model}", "--random", "--dim", "B=2", "--input", "z={tmp}/a.npy"], "--input z: not an input of the model"),
    (["run", "{model}", "--random", "--dim", "B=2", "--input", "cos={tmp}/pickle.npy"], "not a NumPy .npy array without pickles"),
    (["run", "{model}", "--random", "--dim", "B=2", "--input", "cos={tmp}/int.npy"],
     "input 'cos': expected float32 (as the model declares), got int64"),
    (["run", "{model}", "--random", "--dim", "B=2", "--feeds", "{tmp}/int.npy"], "not a NumPy .npz archive"),
    (["run", "{model}", "--random", "--dim", "B=2", "--input", "x={tmp}/inexact.npy"], "not all bfloat16 values"),
    (["run", "{model}", "--random", "--dim", "B=2", "--input", "cos={tmp}"], "is not a regular file"),
    (["run", "{tmp}/int.npy", "--random"], "model '{tmp}/int.npy': "),
    (["check", "{model}", "--target", "ascend310"], "--target 'ascend310': expected one of ascend910b, ascend910_93, "
                                                    "ascend950, ascend310p, kirinx90, kirin9030 or all"),
    (["example", "nope"], "example 'nope': expected one of inplace_partial_rotary_mul"),
])
def test_bad_paths_feeds_and_targets_exit_2_with_one_line(rope_model, tmp_path, capsys, args, message):
    _, model = rope_model
    np.save(tmp_path / "int.npy", np.arange(8))
    np.save(tmp_path / "a.npy", np.zeros(3, np.float32))
    np.save(tmp_path / "pickle.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "inexact.npy", np.full((2, 4, 2, 16), 0.1, np.float32))
    fill = lambda s: s.replace("{model}", str(model)).replace("{tmp}", str(tmp_path))  # noqa: E731
    assert main([fill(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert fill(message) in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_bad_feed_value_is_a_run_error_naming_the_node(tmp_path, capsys):
    graph = moe_graph(4, 8, 4)
    model = tmp_path / "moe.onnx"
    geir.save_onnx(graph, str(model))
    assert main(["run", str(model), "--random"]) == 2        # zeros are not a permutation
    err = capsys.readouterr().err
    assert err.startswith("geir: run error: ") and "sorted_indices" in err


def test_check_exit_status_says_whether_the_device_accepts_it(rope_model, tmp_path):
    _, model = rope_model
    result = _geir("check", str(model), "--target", "ascend910b")
    assert result.returncode == 1 and "[RP-T1]" in result.stdout
    result = _geir("check", str(model), "--target", "all")
    assert result.returncode == 1 and result.stdout.count("graph 'g' on ") == len(TARGETS)
    ok = rotary_graph(ROPE_GRAD, (1, 4, 2, 16), (1, 4, 1, 8), "float16", rotary_mode=1, partial_slice=[0, 8])
    geir.save_onnx(ok, str(tmp_path / "ok.onnx"))
    result = _geir("check", str(tmp_path / "ok.onnx"), "--target", "ascend950")
    assert result.returncode == 0 and "ok (no restriction violated)" in result.stdout


def test_show_text_dot_and_pictures(rope_model, tmp_path, capsys):
    graph, model = rope_model
    result = _geir("show", str(model))
    assert result.returncode == 0 and result.stdout.startswith("graph g(x: bfloat16[B,4,2,16]")
    assert main(["show", str(model), "--format", "dot", "-o", str(tmp_path / "g.dot")]) == 0
    dot = (tmp_path / "g.dot").read_text()
    assert dot.startswith('digraph "g" {') and "ai.cann::InplacePartialRotaryMulGrad" in dot
    assert 'label="x\\nbfloat16[B,4,2,16]"' in dot
    capsys.readouterr()
    empty = tmp_path / "empty-path"
    empty.mkdir()
    os.environ["PATH"], saved = str(empty), os.environ["PATH"]
    try:
        assert main(["show", str(model), "--format", "svg", "-o", str(tmp_path / "g.svg")]) == 2
        assert "needs Graphviz's 'dot' on PATH" in capsys.readouterr().err
        assert geir.load_onnx(str(model))._repr_svg_() is None
        fake = empty / "dot"                     # a stand-in Graphviz: proves the plumbing, not Graphviz
        fake.write_text("#!/bin/sh\nread -r first\necho \"<svg><!-- $1 $first --></svg>\"\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
        assert main(["show", str(model), "--format", "svg", "-o", str(tmp_path / "g.svg")]) == 0
        assert (tmp_path / "g.svg").read_text().startswith('<svg><!-- -Tsvg digraph "g" {')
        capsys.readouterr()
        assert main(["show", str(model), "--format", "svg"]) == 0        # no -o: to stdout, as dot -Tsvg does
        assert capsys.readouterr().out.startswith('<svg><!-- -Tsvg digraph "g" {')
    finally:
        os.environ["PATH"] = saved


def test_example_command_runs_the_ge_ports(tmp_path):
    result = _geir("example", "all", "--dump", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("[XIR]: Session run ir compute graph success") == 4
    assert (tmp_path / "sparse_flash_attention.onnx").exists() and (tmp_path / "moe_token_unpermute_grad.txt").exists()


def test_bench_plot_says_what_it_needs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "moe", "--quick", "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err


def test_bench_marks_each_target_and_draws_the_ratios(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the drawing needs the optional matplotlib (pip install -e '.[plot]')")
    assert main(["bench", "moe", "--quick", "--repeat", "1", "--plot", str(tmp_path / "ratios.png")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "geir onnxruntime, caller buffers" in line
            and line.startswith("MoeTokenUnpermuteGrad")]
    assert len(rows) == 2 and all(("MET <= 1.3x warm np.copyto" in r or "MISSED <= 1.3x warm np.copyto" in r) for r in rows)
    fresh = [line for line in out.splitlines() if "geir onnxruntime  " in line and line.startswith("MoeTokenUnpermuteGrad")]
    torch_present = importlib.util.find_spec("torch") is not None        # the PyTorch target needs a PyTorch row
    assert len(fresh) == 2 and all("<= 1.2x same, into a fresh buffer" in r and ("faster than PyTorch" in r) == torch_present
                                   for r in fresh)
    assert (tmp_path / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_copy_baseline_keeps_its_fastest_rate_per_byte(monkeypatch):
    """A row with other ways to do its work (``also``) keeps the lowest time per unit of work, stated for its own
    work; the baseline's ratios follow it; the larger copies stop at LARGEST_COPY."""
    from geir.tools import bench

    def sleeper(seconds):       # a call that "takes" these seconds: best_time below returns them, so no verdict
        return lambda: seconds  # hangs on how long a sleep lasts on a loaded machine

    fast = (lambda: sleeper(0.002), 4000.0)           # 4x the work in 2 ms: 0.5 us per unit, against 10 us
    rows = [bench.Measurement("Op", "case", "copy", sleeper(0.01), 1000.0, "GB/s", baseline=True, also=(fast,)),
            bench.Measurement("Op", "case", "kernel", sleeper(0.001), 1000.0, "GB/s", targets=(("copy", 1.5),))]
    monkeypatch.setitem(bench.SUITES, "fake", lambda quick: rows)
    monkeypatch.setattr(bench, "best_time", lambda fn, repeat: fn())
    table = bench.run_benchmarks(["fake"], repeat=2, progress=None)
    copy_line = next(line for line in table.splitlines() if line.startswith("Op") and "  copy  " in line)
    kernel_line = next(line for line in table.splitlines() if line.startswith("Op") and "kernel" in line)
    assert float(copy_line.split()[3]) < 1.0                  # about 0.5 ms for the row's 1000 units, not 10 ms
    assert "MISSED <= 1.5x copy" in kernel_line               # 1 ms against 0.5 ms: 2x (against 10 ms it would be met)
    assert [work for _, work in bench.larger_copies(1000)] == [4000.0, 8000.0]   # bytes read and written
    assert len(bench.larger_copies(bench.LARGEST_COPY // 2)) == 1


def test_fuse_into_its_own_input_keeps_it_when_the_export_fails(rope_model, monkeypatch, capsys):
    """Issue 23 item 13: `geir fuse IN IN` on a fused graph that cannot be exported left IN at 0 bytes."""
    from geir.ir import _onnx_export

    _, model = rope_model
    before = model.read_bytes()

    def refuse(graph):
        raise geir.GraphError("MoeTokenUnpermute 'b': cannot export: made to fail by the test")

    monkeypatch.setattr(_onnx_export, "to_onnx", refuse)
    assert main(["fuse", str(model), str(model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot export: made to fail by the test" in err
    assert model.read_bytes() == before and sorted(p.name for p in model.parent.iterdir()) == [model.name]


def test_fuse_allow_stricter_data_fuses_what_fed_indices_keep_a_near_miss(tmp_path, capsys):
    """Fed MoE indices: without the flag the match is a near miss (the op refuses indices the subgraph takes);
    with it the model holds the op, and the report says so."""
    b = geir.GraphBuilder("moe")
    permuted, idx = b.input("permuted", "float32", (6, 4)), b.input("idx", "int32", (6,))
    shape, axes = b.constant("shape", np.array([3, 2, 4], np.int64)), b.constant("axes", np.array([1], np.int64))
    rows = b.op("Reshape", b.op("Gather", permuted, idx, axis=0), shape)
    b.output(b.op("ReduceSum", rows, axes, keepdims=0), "y")
    source = tmp_path / "moe.onnx"
    geir.save_onnx(b.build(), str(source))
    ops = {}
    for flags in ((), ("--allow-stricter-data",)):
        out = tmp_path / f"fused{len(flags)}.onnx"
        assert main(["fuse", str(source), str(out), *flags]) == 0
        ops[flags] = [n.op_type for n in geir.load_onnx(str(out)).nodes]
        ops[flags, "report"] = capsys.readouterr().out
    assert "MoeTokenUnpermute" not in ops[()] and "missed" in ops[(), "report"]
    assert "MoeTokenUnpermute" in ops[("--allow-stricter-data",)]
    assert "1 fused" in ops[("--allow-stricter-data",), "report"]


def test_run_output_is_replaced_whole_or_not_at_all(rope_model, tmp_path, monkeypatch, capsys):
    """A write that fails half way (a full disk) keeps the previous --output file and exits 2 with one line."""
    _, model = rope_model
    out = tmp_path / "out.npz"
    assert main(["run", str(model), "--random", "--dim", "B=2", "--output", str(out)]) == 0
    before = out.read_bytes()
    write_array = np.lib.format.write_array

    def fill_the_disk(fp, array, *args, **kwargs):
        write_array(fp, array, *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np.lib.format, "write_array", fill_the_disk)
    capsys.readouterr()
    assert main(["run", str(model), "--random", "--dim", "B=3", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"geir run: --output {str(out)!r}: cannot write it (No space left on device)\n"
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["out.npz", "rope_grad.onnx"]


def test_run_output_names_are_not_savez_keywords(tmp_path):
    """np.savez(path, **outputs) fails for an output named 'file' or 'allow_pickle'; the writer takes any name."""
    from geir.tools.model_io import save_outputs

    arrays = {"file": np.arange(3, dtype=np.int32), "allow_pickle": np.ones((2, 2), ml_dtypes.bfloat16)}
    assert save_outputs(str(tmp_path / "o.npz"), arrays) == ["allow_pickle"]
    with np.load(tmp_path / "o.npz") as back:
        np.testing.assert_array_equal(back["file"], arrays["file"])
        assert back["allow_pickle"].dtype == np.float32 and (back["allow_pickle"] == 1).all()


def test_bench_plot_that_fails_to_draw_keeps_the_old_picture(tmp_path, monkeypatch):
    """The bar chart goes through the same helper: a savefig that fails half way leaves the old file."""
    from types import SimpleNamespace

    from geir.tools import bench_plot

    def savefig(target, **kwargs):       # writes half a PNG, then fails as a full disk would
        if isinstance(target, (str, os.PathLike)):
            with open(target, "wb") as f:
                f.write(b"\x89PNG half")
        else:
            target.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    figure = SimpleNamespace(tight_layout=lambda: None, savefig=savefig)
    closed, axes = [], object()
    plt = SimpleNamespace(subplots=lambda **k: (figure, axes), close=closed.append)
    monkeypatch.setattr(bench_plot, "pyplot", lambda: plt)
    monkeypatch.setattr(bench_plot, "_plot", lambda ax, slots: None)       # what is drawn is not the point here
    picture = tmp_path / "ratios.png"
    picture.write_bytes(b"old picture")
    with pytest.raises(OSError, match="No space left"):
        bench_plot.draw(str(picture), [bench_plot.Bar("Op", "a", 1.0, (), "no target")])
    assert picture.read_bytes() == b"old picture" and [p.name for p in tmp_path.iterdir()] == ["ratios.png"]
    assert closed == [figure]


def test_a_run_out_of_memory_is_one_line(rope_model, monkeypatch, capsys):
    """A model whose intermediates outgrow the machine ends with exit 2 and one line, not a MemoryError traceback."""
    from types import SimpleNamespace

    from geir.tools import commands

    def run(feeds):
        raise MemoryError("Unable to allocate 1.5 PiB for an array with shape (10**15,)")

    monkeypatch.setattr(commands, "get_runtime", lambda name: SimpleNamespace(compile=lambda g: SimpleNamespace(run=run)))
    _, model = rope_model
    assert main(["run", str(model), "--random", "--dim", "B=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("geir run: out of memory (Unable to allocate 1.5 PiB")


def test_a_family_without_a_suite_of_its_own_is_benched_from_its_examples(monkeypatch):
    """A new op family gets ``geir bench`` rows from its ``examples.BENCH`` alone: every runtime (and reused
    buffers) against the copy of the bytes it moves."""
    import sys
    import types
    from dataclasses import dataclass

    from geir.tools import bench

    @dataclass(frozen=True)
    class Case:
        op: str = ROPE_GRAD
        label: str = "(1,8,2,16) float32"

        def arrays(self):
            rng = np.random.default_rng(0)
            return {"dy": rng.standard_normal((1, 8, 2, 16), np.float32),
                    "cos": rng.standard_normal((1, 8, 1, 16), np.float32),
                    "sin": rng.standard_normal((1, 8, 1, 16), np.float32)}

        def attributes(self):
            return {"rotary_mode": 1, "partial_slice": [0, 16]}
    examples = types.ModuleType("geir.schemas.toy.examples")
    examples.BENCH = {"quick": (Case(),), "bench": (Case(), Case())}
    monkeypatch.setitem(sys.modules, "geir.schemas.toy.examples", examples)
    rows = bench.family_suite("toy")(True)
    assert [r.name for r in rows] == [bench.WARM_COPY, bench.FRESH_COPY] + [
        f"geir {runtime}{suffix}" for runtime in geir.runtimes.runtime_names() for suffix in ("", bench.BUFFERS)]
    assert {r.op for r in rows} == {ROPE_GRAD} and rows[0].work == 2 * 256 * 4 + 2 * 128 * 4   # dy and dx, cos and sin
    for row in rows:
        row.fn()
    assert len(bench.family_suite("toy")(False)) == 2 * len(rows)
