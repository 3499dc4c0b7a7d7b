from __future__ import annotations

import subprocess
import sys

import pytest

from geir.tools import demo
from geir.tools.cli import main


def test_demo_passes_and_prints_the_table(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "case" in out and "max error" in out and "GE IR example (E3)" in out and "CANN example (2,2,2,8) mode 1" in out
    for dtype in ("float32", "float16", "bfloat16"):
        assert dtype in out
    assert "FAIL" not in out and "MoeTokenUnpermuteGrad" in out and "CANN doc example (E1)" in out
    passed, total = out.strip().splitlines()[-1].split()[0].split("/")
    assert passed == total and int(total) >= 30


def test_demo_fails_loudly_when_a_case_is_wrong(monkeypatch, capsys):
    cases = demo.all_cases()
    cases[1].expected = {name: value + 1.0 for name, value in cases[1].expected.items()}
    monkeypatch.setattr(demo, "all_cases", lambda: cases)
    assert main(["demo"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 1 and f"{len(cases) - 1}/{len(cases)} cases passed" in out


@pytest.mark.slow      # 20 s, the default run's longest test; `geir bench sfa --quick` below stays in it
def test_bench_quick_prints_one_table_with_both_runtimes(capsys):
    assert main(["bench", "rotary", "moe", "--quick", "--repeat", "1"]) == 0
    captured = capsys.readouterr()
    out = "\n".join(line for line in captured.out.splitlines() if line.startswith(("Inplace", "Moe")))
    from geir.runtimes.onnxruntime._native import find_compiler

    kernels = "native kernels:" if find_compiler() is not None else "function bodies only (RuntimeError: no C compiler"
    assert f"onnxruntime: {kernels}" in captured.out and "vs baseline" in captured.out
    for impl, count in (("naive NumPy formula", 4), ("warm np.copyto, 1-4x the bytes", 4 + 8),   # rows + targets naming it
                        ("same, into a fresh buffer", 4)):
        assert out.count(impl) >= count, impl
    assert out.count("geir numpy, caller buffers") == 8 and out.count("geir onnxruntime, caller buffers") == 8
    assert out.count("geir numpy") == 16 and out.count("geir onnxruntime") == 16    # grad and forward, two cases each
    summary = captured.out.strip().splitlines()[-1]
    assert summary.startswith("targets: ") and " met, " in summary and " missed (of " in summary
    assert "GB/s" in out
    baselines = [line for line in out.splitlines() if "warm np.copyto, 1-4x the bytes  " in line]
    assert len(baselines) == 4 and all("1.00x" in line for line in baselines)   # each case's baseline (other rows
    # may round to 1.00x too: a fresh-buffer copy often does)
    assert "[" in captured.err and "/" in captured.err                       # the progress bar


def test_bench_sfa_quick(capsys):
    assert main(["bench", "sfa", "--quick", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s" in out and "float32 matmul" in out
    assert out.count("geir numpy") == 2 and out.count("geir onnxruntime") == 2


def test_unknown_benchmark_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "nothing"])
    assert exit_info.value.code == 2 and "unknown benchmark(s) ['nothing']" in capsys.readouterr().err


def test_console_script_module_runs():
    result = subprocess.run([sys.executable, "-m", "geir.tools.cli", "demo"], capture_output=True, text=True)
    assert result.returncode == 0 and "cases passed" in result.stdout


# Every command x every kind of bad argument (issue 23 item 19): exit 2 and exactly one line on stderr. A kind
# that names a file, a size or an output applies to the commands that take one; the argument-parsing kinds
# apply to every command. Each case names a fragment of the one line, so a different failure cannot pass.
COMMANDS = ("demo", "bench", "run", "check", "show", "fuse", "example")
BAD = {
    "unknown option": {
        "demo": (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        "bench": (["bench", "--bogus"], "unrecognized arguments: --bogus"),
        "run": (["run", "{model}", "--bogus"], "unrecognized arguments: --bogus"),
        "check": (["check", "{model}", "--target", "all", "--bogus"], "unrecognized arguments: --bogus"),
        "show": (["show", "{model}", "--bogus"], "unrecognized arguments: --bogus"),
        "fuse": (["fuse", "{model}", "{tmp}/out.onnx", "--bogus"], "unrecognized arguments: --bogus"),
        "example": (["example", "--bogus"], "unrecognized arguments: --bogus"),
    },
    "stray argument": {
        "demo": (["demo", "extra"], "unrecognized arguments: extra"),
        "bench": (["bench", "extra"], "unknown benchmark(s) ['extra']"),
        "run": (["run", "{model}", "extra"], "unrecognized arguments: extra"),
        "check": (["check", "{model}", "extra", "--target", "all"], "unrecognized arguments: extra"),
        "show": (["show", "{model}", "extra"], "unrecognized arguments: extra"),
        "fuse": (["fuse", "{model}", "{tmp}/out.onnx", "extra"], "unrecognized arguments: extra"),
        "example": (["example", "all", "extra"], "unrecognized arguments: extra"),
    },
    "bad value": {
        "demo": (["demo", "--runtime", "nope"], "argument --runtime: invalid choice: 'nope'"),
        "bench": (["bench", "--repeat", "0"], "argument --repeat: expected an integer >= 1, got '0'"),
        "run": (["run", "{model}", "--random", "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
        "check": (["check", "{model}", "--target", "nope"], "--target 'nope': expected one of"),
        "show": (["show", "{model}", "--format", "nope"], "argument --format: invalid choice: 'nope'"),
        "fuse": (["fuse", "{model}", "{tmp}"], "output '{tmp}': cannot write it (Is a directory)"),
        "example": (["example", "nope"], "example 'nope': expected one of"),
    },
    "missing value": {
        "demo": (["demo", "--runtime"], "argument --runtime: expected one argument"),
        "bench": (["bench", "--plot"], "argument --plot: expected one argument"),
        "run": (["run"], "the following arguments are required: model"),
        "check": (["check", "{model}"], "the following arguments are required: --target"),
        "show": (["show"], "the following arguments are required: model"),
        "fuse": (["fuse", "{model}"], "the following arguments are required: output"),
        "example": (["example", "--dump"], "argument --dump: expected one argument"),
    },
    "non-ASCII digits": {
        "bench": (["bench", "--repeat", "²"], "argument --repeat: expected an integer >= 1, got '²'"),
        "run": (["run", "{model}", "--random", "--dim", "B=²"], "--dim B=²: expected a size >= 0 (decimal digits)"),
    },
    "missing file": {cmd: ([cmd, "{tmp}/MISSING.onnx"] + extra, "model '{tmp}/MISSING.onnx': no such file")
                     for cmd, extra in (("run", ["--random"]), ("check", ["--target", "all"]), ("show", []),
                                        ("fuse", ["{tmp}/out.onnx"]))},
    "not a model": {cmd: ([cmd, "{tmp}/junk.onnx"] + extra, "is not an ONNX model")
                    for cmd, extra in (("run", ["--random"]), ("check", ["--target", "all"]), ("show", []),
                                       ("fuse", ["{tmp}/out.onnx"]))},
    "output in a missing directory": {
        "bench": (["bench", "--plot", "{tmp}/no/dir/x.png"], "--plot '{tmp}/no/dir/x.png': cannot write it: the "
                                                             "directory '{tmp}/no/dir' does not exist"),
        "run": (["run", "{model}", "--random", "--dim", "B=2", "--output", "{tmp}/no/dir/o.npz"],
                "--output '{tmp}/no/dir/o.npz': cannot write it: the directory '{tmp}/no/dir' does not exist"),
        "show": (["show", "{model}", "-o", "{tmp}/no/dir/g.txt"],
                 "-o '{tmp}/no/dir/g.txt': cannot write it: the directory '{tmp}/no/dir' does not exist"),
        "fuse": (["fuse", "{model}", "{tmp}/no/dir/f.onnx"],
                 "output '{tmp}/no/dir/f.onnx': cannot write it: the directory '{tmp}/no/dir' does not exist"),
        "example": (["example", "--dump", "{tmp}/junk.onnx/dump"], "--dump '{tmp}/junk.onnx/dump': aclgrphDumpGraph"),
    },
    "huge size": {
        "run": (["run", "{model}", "--random", "--dim", "B=100000000000000"],
                "--random: input 'x' of shape [100000000000000, 4, 2, 16] would take the random feeds to"),
    },
    "file claiming a huge array": {
        "run": (["run", "{model}", "--random", "--dim", "B=2", "--input", "cos={tmp}/huge.npy"],
                "--input cos={tmp}/huge.npy: its header claims shape (10000000000000, 4) of float32 (160000000000000 "
                "bytes), but the file holds 16 bytes of data"),
    },
    "file claiming an empty array of a huge dim": {
        "run": (["run", "{model}", "--random", "--dim", "B=2", "--input", "cos={tmp}/empty_huge.npy"],
                "--input cos={tmp}/empty_huge.npy: its header claims shape (0, 1000000000000000000000000000000): a "
                "dimension past 2**63 - 1"),
    },
    "file with a header that does not parse": {
        "run": (["run", "{model}", "--random", "--dim", "B=2", "--input", "cos={tmp}/open_bracket.npy"],
                "--input cos={tmp}/open_bracket.npy: not a NumPy .npy array"),
    },
    "output path naming a directory": {
        "fuse": (["fuse", "{model}", "{tmp}/model.onnx/"], "output '{tmp}/model.onnx/'"),
    },
    "archive claiming a huge array": {
        "run": (["run", "{model}", "--random", "--dim", "B=2", "--feeds", "{tmp}/huge.npz"],
                "--feeds '{tmp}/huge.npz': array 'cos': its header claims shape (10000000000000, 4)"),
    },
}
ARGUMENT_KINDS = ("unknown option", "stray argument", "bad value", "missing value")


def test_every_command_meets_every_argument_kind():
    assert all(set(BAD[kind]) == set(COMMANDS) for kind in ARGUMENT_KINDS)
    assert {cmd for cases in BAD.values() for cmd in cases} == set(COMMANDS)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    import io
    import zipfile

    import numpy as np

    import geir
    from rotary.helpers import ROPE_GRAD, rotary_graph

    tmp = tmp_path_factory.mktemp("bad")
    graph = rotary_graph(ROPE_GRAD, ("B", 4, 2, 16), (1, 4, 1, 8), "float32", rotary_mode=1, partial_slice=[4, 12])
    geir.save_onnx(graph, tmp / "model.onnx")
    (tmp / "junk.onnx").write_bytes(b"not a protobuf at all \xff\xff")
    header = io.BytesIO()       # a 16-byte .npy whose header claims 10^13 x 4 float32 (NumPy would allocate 160 TB)
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**13, 4)})
    (tmp / "huge.npy").write_bytes(header.getvalue() + bytes(16))
    empty = io.BytesIO()        # no element, yet a dim no array can have (NumPy's reader raises OverflowError)
    np.lib.format.write_array_header_1_0(empty, {"descr": "<f4", "fortran_order": False, "shape": (0, 10**30)})
    (tmp / "empty_huge.npy").write_bytes(empty.getvalue())
    text = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, }"     # a bracket left open
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    (tmp / "open_bracket.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + bytes(24))
    with zipfile.ZipFile(tmp / "huge.npz", "w") as archive:
        archive.writestr("cos.npy", header.getvalue() + bytes(16))
    return tmp


@pytest.mark.parametrize("kind, command", [(kind, cmd) for kind, cases in BAD.items() for cmd in cases])
def test_bad_arguments_exit_2_with_one_line(bad_files, capsys, kind, command):
    args, fragment = BAD[kind][command]
    fill = lambda s: s.replace("{model}", str(bad_files / "model.onnx")).replace("{tmp}", str(bad_files))  # noqa: E731
    before = sorted(p.name for p in bad_files.iterdir())
    try:
        status = main([fill(a) for a in args])
    except SystemExit as exc:       # argparse's own exit
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    assert fill(fragment) in err, err
    assert sorted(p.name for p in bad_files.iterdir()) == before     # nothing written, no temporary file left


def test_a_reader_that_closes_stdout_early_loses_the_printout_not_the_work(tmp_path):
    """``geir run ... --output F | head -1``: the output file is still written, exit 0, stderr empty (no
    BrokenPipeError traceback, no 'Exception ignored' at exit)."""
    import numpy as np

    import geir
    from rotary.helpers import ROPE_GRAD, rotary_graph

    graph = rotary_graph(ROPE_GRAD, ("B", 4, 2, 16), (1, 4, 1, 8), "float32", rotary_mode=1, partial_slice=[4, 12])
    geir.save_onnx(graph, tmp_path / "model.onnx")
    process = subprocess.Popen([sys.executable, "-m", "geir", "run", str(tmp_path / "model.onnx"), "--random",
                                "--dim", "B=2", "--repeat", "1", "--output", str(tmp_path / "out.npz")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()              # the reader is gone before the first line is printed
    with process.stderr:
        err = process.stderr.read().decode()
    assert process.wait(timeout=300) == 0 and err == ""
    assert np.load(tmp_path / "out.npz")["y"].shape == (2, 4, 2, 16)


def test_a_closed_stdout_descriptor_loses_the_printout_not_the_work(tmp_path):
    """``geir run ... --output F >&-`` (no stdout at all: sys.stdout is None): the file is written, exit 0."""
    import numpy as np

    import geir
    from rotary.helpers import ROPE_GRAD, rotary_graph

    graph = rotary_graph(ROPE_GRAD, ("B", 4, 2, 16), (1, 4, 1, 8), "float32", rotary_mode=1, partial_slice=[4, 12])
    geir.save_onnx(graph, tmp_path / "model.onnx")
    command = [sys.executable, "-m", "geir", "run", str(tmp_path / "model.onnx"), "--random", "--dim", "B=2",
               "--output", str(tmp_path / "out.npz")]
    result = subprocess.run(["bash", "-c", 'exec "$@" >&-', "bash", *command], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert np.load(tmp_path / "out.npz")["y"].shape == (2, 4, 2, 16)


class _GoneReader:
    """A stdout whose reader has gone: every write and flush raises BrokenPipeError, as a closed pipe does."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_gone_reader_is_not_an_error_for_any_printout(bad_files, monkeypatch, capsys):
    """--version and --help print inside argument parsing; show prints the graph: none raises, and the
    command's own status comes back (0), with nothing on stderr."""
    gone = _GoneReader()
    monkeypatch.setattr(sys, "stdout", gone)
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert main(["show", str(bad_files / "model.onnx")]) == 0
    assert main(["check", str(bad_files / "model.onnx"), "--target", "all"]) == 1     # its status, not the pipe's
    assert gone.writes == 3 and sys.stdout is gone      # one per command: after it fails, nothing more is tried
    assert capsys.readouterr().err == ""
