"""``geir.torch.run`` and ``geir.torch.to_torch`` as a type checker sees them from a user's script (issue 30 item 6):
``mypy --strict`` finds ``geir.torch`` (through the root's ``torch.pyi``: Python reaches it by an import hook, which
mypy does not run), reports nothing, and reveals torch tensors; the script then runs and its claims hold.

mypy with torch's stubs takes tens of seconds cold: slow, and run where torch is installed (CI's models step)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")

pytestmark = [pytest.mark.slow, pytest.mark.models]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """\
from __future__ import annotations

import numpy as np
import torch

import geir
import geir.torch

b = geir.GraphBuilder("twice")
x = b.input("x", "bfloat16", (2, 3))
wide = b.op("Cast", x, to=geir.float32.onnx)
b.output(b.op("Cast", b.op("Add", wide, wide), to=geir.bfloat16.onnx), "y")
g = b.build()

feed = torch.ones(2, 3, dtype=torch.bfloat16)
outs = geir.torch.run(g, {"x": feed}, runtime="onnxruntime")
y: torch.Tensor = outs["y"]
buffer = torch.empty(2, 3, dtype=torch.bfloat16)
same: torch.Tensor = geir.torch.run(g, {"x": feed}, outputs={"y": buffer})["y"]
arrays = geir.run(g, {"x": np.ones((2, 3), np.float32).astype(geir.bfloat16.numpy)})
reveal_type(outs)
reveal_type(geir.torch.to_torch(arrays))
reveal_type(geir.torch.to_torch(arrays["y"]))
reveal_type(geir.torch.to_torch((arrays["y"], arrays["y"])))
reveal_type(geir.torch.to_torch([arrays["y"]]))
assert y.dtype == torch.bfloat16 and same is buffer and torch.equal(y, same)
assert torch.equal(geir.torch.to_torch(arrays)["y"], y)
print("typed torch script: ok")
"""
REVEALED = ["dict[str, torch._tensor.Tensor]", "dict[str, torch._tensor.Tensor]", "torch._tensor.Tensor",
            "tuple[torch._tensor.Tensor, ...]", "list[torch._tensor.Tensor]"]


def test_mypy_strict_sees_geir_torch_run_and_to_torch_and_the_script_runs(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "geir").symlink_to(ROOT, target_is_directory=True)   # as an editable install links it
    (tmp_path / "user.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    checked = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
                              "--no-error-summary", "--hide-error-context", "user.py"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=900)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    revealed = [line.split('Revealed type is "', 1)[1][:-1].replace("builtins.", "")   # as older mypy writes
                for line in checked.stdout.splitlines() if "Revealed type is" in line]
    assert revealed == REVEALED

    script = SCRIPT.replace("reveal_type(", "print(")
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={**env, "GEIR_NATIVE": "0"},
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.endswith("typed torch script: ok\n")
