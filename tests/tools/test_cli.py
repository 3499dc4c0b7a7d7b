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
    cases[1].expected = cases[1].expected + 1.0
    monkeypatch.setattr(demo, "all_cases", lambda: cases)
    assert main(["demo"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 1 and f"{len(cases) - 1}/{len(cases)} cases passed" in out


def test_bench_quick_prints_ratios(capsys):
    assert main(["bench", "rotary", "--quick", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for impl in ("np.copyto(dy)", "geir numpy runtime", "naive NumPy formula"):
        assert out.count(impl) == 2
    assert "effective GB/s" in out and "vs copy" in out


def test_bench_moe_quick(capsys):
    assert main(["bench", "moe", "--quick", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("geir numpy runtime") == 2 and "into a fresh buffer" in out and "bfloat16" in out


def test_bench_sfa_quick(capsys):
    assert main(["bench", "sfa", "--quick", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s" in out and "geir numpy runtime, grad" in out and "vs matmul" in out


def test_unknown_benchmark_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "nothing"])
    assert exit_info.value.code == 2 and "unknown benchmark(s) ['nothing']" in capsys.readouterr().err


def test_console_script_module_runs():
    result = subprocess.run([sys.executable, "-m", "geir.tools.cli", "demo"], capture_output=True, text=True)
    assert result.returncode == 0 and "cases passed" in result.stdout
