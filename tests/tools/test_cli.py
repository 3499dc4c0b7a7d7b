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
