"""The examples/ scripts run as a user runs them (a fresh interpreter, from the checkout) and pass their own checks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_torch_moe_training_trains_through_the_npu_shim_and_matches_float64():
    run = subprocess.run([sys.executable, str(EXAMPLES / "torch_moe_training.py")], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(v) for v in re.findall(r"^step \d+: loss (\S+)$", run.stdout, re.MULTILINE)]
    assert len(losses) == 8 and losses[-1] < losses[0] / 4, run.stdout    # it learns
    check = re.search(r"^check against float64 PyTorch: max relative error (\S+) \(tolerance (\S+)\): ok$",
                      run.stdout, re.MULTILINE)
    assert check is not None, run.stdout
    assert float(check[1]) <= float(check[2]) <= 1e-4
    assert "torch_npu" not in sys.modules          # the shim lived in the example's process only
