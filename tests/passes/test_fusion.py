"""geir.fuse, the pass: near misses say why and change nothing, the original graph is left as it was, the command
line, models exported from PyTorch modules written the usual way fuse, a matcher that fails is reported. Each
family's patterns are tested in its folder (tests/<family>/test_*_fusion.py)."""

from __future__ import annotations

import io
import warnings

import pytest

import geir
from helpers import assert_same_function
from moe.helpers import unpermute_subgraph
from rotary.helpers import rope_subgraph, rotate_half


def test_near_misses_say_why_and_change_nothing():
    original = unpermute_subgraph(indices=[0, 0, 1, 2, 3, 4])               # a repeat: not a permutation
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert "MoeTokenUnpermute" not in [n.op_type for n in fused.nodes]
    assert [m.reason for m in report.near_misses] == [
        "the gather indices are not a permutation of 0..M-1 (MoeTokenUnpermute requires one, MU-D1)"]
    b = geir.GraphBuilder("rank2")                                           # tables of rank 2, as (S, D)
    x = b.input("x", "float32", (2, 4, 3, 8))
    cos = b.input("cos", "float32", (3, 8))
    sin = b.input("sin", "float32", (3, 8))
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotate_half(b, x, 8), sin)), "y")
    original = b.build()
    fused, report = geir.fuse(original)
    assert [n.op_type for n in fused.nodes] == [n.op_type for n in original.nodes]
    assert len(report.near_misses) == 1 and report.near_misses[0].reason.startswith(
        "cos has rank 2; the rotary ops take rank-4 x, cos and sin")
    assert "missed rotary half" in str(report)
    b = geir.GraphBuilder("other")                                           # rotate_half of another tensor
    x, z = b.input("x", "float32", (1, 2, 1, 8)), b.input("z", "float32", (1, 2, 1, 8))
    cos = b.input("cos", "float32", (1, 2, 1, 8))
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotate_half(b, z, 8), cos)), "y")
    _, report = geir.fuse(b.build())
    assert report.near_misses[0].reason == "the rotated term reads 'z' but the other product does not multiply it"


def test_the_original_graph_is_not_modified():
    original = rope_subgraph("half")
    before = str(original)
    geir.fuse(original, allow_stricter_data=True)
    assert str(original) == before


def test_geir_fuse_on_the_command_line(tmp_path, capsys):
    from geir.tools.cli import main

    source, target = tmp_path / "rope.onnx", tmp_path / "fused.onnx"
    geir.save_onnx(rope_subgraph("interleaved"), source)
    assert main(["fuse", str(source), str(target)]) == 0
    printed = capsys.readouterr().out
    assert "1 fused, 0 near misses" in printed and f"wrote {target}" in printed
    assert [n.op_type for n in geir.load_onnx(target).nodes] == ["InplacePartialRotaryMul"]


def _export(module, args, names):
    torch = pytest.importorskip("torch")
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # the TorchScript exporter warns that it is the legacy one
        try:
            torch.onnx.export(module, args, buffer, dynamo=False, opset_version=18, input_names=names,
                              output_names=["y"])
        except Exception as exc:                # an exporter that does not work here: nothing to test
            pytest.skip(f"torch.onnx.export is not usable here: {type(exc).__name__}: {exc}")
    import onnx
    return geir.from_onnx(onnx.load_from_string(buffer.getvalue()))


def test_models_exported_from_pytorch_fuse():
    torch = pytest.importorskip("torch")

    class LlamaRope(torch.nn.Module):
        def forward(self, x, cos, sin):
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    class GptjRope(torch.nn.Module):
        def forward(self, x, cos, sin):
            rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
            return x * cos + rotated * sin

    class MlaRope(torch.nn.Module):
        def forward(self, x, cos, sin):
            nope, pe = x[..., :8], x[..., 8:]
            half = pe.shape[-1] // 2
            pe = pe * cos + torch.cat((-pe[..., half:], pe[..., :half]), dim=-1) * sin
            return torch.cat((nope, pe), dim=-1)

    class Unpermute(torch.nn.Module):
        def forward(self, permuted, idx, probs):
            rows = permuted[idx].reshape(3, 2, 4)
            return (rows * probs.unsqueeze(-1)).sum(dim=1)

    class ScatterUnpermute(torch.nn.Module):
        def forward(self, permuted, row2slot, probs):
            placed = torch.zeros_like(permuted)
            placed[row2slot] = permuted
            return (placed.reshape(3, 2, 4) * probs.unsqueeze(-1)).sum(dim=1)

    x, table = torch.randn(2, 4, 3, 8), torch.randn(1, 4, 1, 8)
    cases = [(LlamaRope(), (x, table, table), ["x", "cos", "sin"], "InplacePartialRotaryMul"),
             (GptjRope(), (x, table, table), ["x", "cos", "sin"], "InplacePartialRotaryMul"),
             (MlaRope(), (torch.randn(2, 4, 3, 16), table, table), ["x", "cos", "sin"], "InplacePartialRotaryMul"),
             (Unpermute(), (torch.randn(6, 4), torch.randperm(6).to(torch.int32), torch.rand(3, 2)),
              ["permuted", "idx", "probs"], "MoeTokenUnpermute"),
             (ScatterUnpermute(), (torch.randn(6, 4), torch.randperm(6), torch.rand(3, 2)),
              ["permuted", "idx", "probs"], "MoeTokenUnpermute")]
    for module, args, names, op in cases:
        original = _export(module, args, names)
        fused, report = geir.fuse(original, allow_stricter_data=True)
        assert op in [n.op_type for n in fused.nodes], (type(module).__name__, str(report), str(original))
        assert_same_function(original, fused, runtimes=("numpy",))


def test_a_matcher_that_fails_is_reported_not_raised(monkeypatch):
    from geir.schemas import patterns

    def broken(view, node):
        raise KeyError("surprise")
    from geir.passes import fusion
    monkeypatch.setattr(fusion, "patterns", lambda: (*patterns.patterns(), patterns.Pattern("broken", "Add", broken)))
    _, report = geir.fuse(rope_subgraph("half"))
    assert len(report.fused) == 1                                   # the real pattern still fused the rope
    graph = _graph_add()
    _, report = geir.fuse(graph)
    assert [(m.pattern, m.reason) for m in report.near_misses] == [
        ("broken", "the matcher failed on this node (KeyError: 'surprise')")]


def _graph_add() -> geir.Graph:
    b = geir.GraphBuilder("add")
    x = b.input("x", "float32", (2,))
    b.output(b.op("Add", x, x), "y")
    return b.build()
