"""``geir show --format dot`` on a real export (issue 30): a tiny Llama decoder layer (random weights from a config)
exported by both of PyTorch's exporters draws with its weights and constants folded into their consumers' boxes,
edges labelled by type with generated symbols abbreviated, and nodes clustered by module: from the dynamo
exporter's recorded scopes, and from TorchScript's '/model/layers.0/...' node names; and the example that draws
the three model pictures runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import geir
from dot_reader import Dot
from geir.ir._dot_text import OURS_FILL
from geir.tools.cli import main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from real_models import export, model  # noqa: E402  (needs torch and transformers)

pytestmark = [pytest.mark.slow, pytest.mark.models]


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_llama_block_draws_folded_typed_and_clustered(exporter, tmp_path, capsys):
    path = tmp_path / "llama.onnx"
    export(model("llama", torch.float32), path, exporter, dynamic=True, dtype=torch.float32)
    assert main(["show", str(path), "--format", "dot"]) == 0
    dot = Dot(capsys.readouterr().out)
    graph = geir.load_onnx(path)

    ops = dot.op_nodes()
    assert len(ops) == len(graph.nodes) and not [k for k in dot.nodes if k.startswith("c")]   # constants: no boxes
    projections = [(node, v) for node in graph.nodes if node.op_type in ("MatMul", "Gemm")
                   for v in node.inputs if v is not None and v in graph.constant_values and v.type.rank == 2]
    assert len(projections) >= 7, "q, k, v, o and the MLP's three weights are constants of their MatMuls"
    for node, weight in projections:                  # a row 'name: float32[32,16]', the name relative to its box
        rows = dot.html_text(dot.node_named(node.name)).splitlines()
        assert any(row.endswith(f": {weight.type}") and weight.name.endswith(row.split(": ")[0]) for row in rows), \
            (node.name, weight.name, rows)

    labels = [a["label"] for _, _, a in dot.edges]
    assert all(re.fullmatch(r"(float32|int64|bool)\[[A-Za-z0-9_,]*\]", label) for label in labels), set(labels)
    assert "float32[batch,seq,32]" in labels                 # the input's symbols keep their names
    assert not any("unk__" in label or "_dim_" in label for label in labels)    # generated ones: s0, s1, ...
    used = {d for label in labels for d in re.findall(r"[\[,](s\d+)(?=[,\]])", label)}
    legend = {line.split(" = ")[0] for line in dot.caption() if re.fullmatch(r"s\d+ = \S+", line)}
    assert used <= legend and used, (used, legend)

    where = {dot.where[k] for k in ops}
    for module in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        assert ("model", "layers.0", module) in where, (module, where)
    (softmax,) = [k for k, tip in ops.items() if tip.startswith("Softmax ")]
    assert dot.where[softmax] == ("model", "layers.0", "self_attn")


def test_the_example_draws_the_attention_block_as_exported_and_fused(tmp_path):
    example = Path(__file__).parents[2] / "examples" / "draw_exported_models.py"
    run = subprocess.run([sys.executable, str(example), "--out", str(tmp_path), "--model", "attention_block"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^attention_block: \d+ nodes, \d+ constants; fused: \d+ nodes \(2 matches\)$", run.stdout,
                     re.MULTILINE), run.stdout
    if shutil.which("dot") is None:
        fused = (tmp_path / "attention_block_fused.dot").read_text()
    else:
        assert (tmp_path / "attention_block.png").read_bytes().startswith(b"\x89PNG")
        fused = (tmp_path / "attention_block_fused.svg").read_text()
    assert fused.count("InplacePartialRotaryMul") >= 2 and OURS_FILL in fused    # the fused ropes, highlighted
