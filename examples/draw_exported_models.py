"""Draw three models as PyTorch exports them: what ``geir show --format svg`` makes of real exported graphs.

Three tiny Hugging Face transformers modules (random weights from configs, nothing downloaded), exported by
``torch.onnx.export(..., dynamo=True)`` with a dynamic batch and sequence:

- ``llama_block``: a Llama decoder layer (RMSNorm, attention with rotary embedding, SwiGLU MLP, final norm);
- ``moe_block``: a Qwen2-MoE decoder layer (router, top-2 of 4 experts, shared expert);
- ``attention_block``: Llama's attention alone (projections, rotary embedding, causal softmax attention).

For each it writes ``NAME.onnx``, the picture of the export (``NAME.svg``, ``NAME.png``) and the picture after
``geir.fuse`` (``NAME_fused.*``: its rotary embeddings become our ``InplacePartialRotaryMul``, drawn orange). The
pictures cluster nodes by the module scopes the exporter records (what ``geir show`` reads from the file).

    python examples/draw_exported_models.py --out pictures      (needs torch and transformers:
                                                                  pip install 'geir[models]'; Graphviz's dot for
                                                                  SVG/PNG: apt-get install graphviz)

Without Graphviz it writes the DOT text (``NAME.dot``) and says so.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

try:
    import torch
    import transformers
except ImportError as exc:            # the pictures are of PyTorch exports: nothing to draw without it
    sys.exit(f"draw_exported_models.py needs torch and transformers ({exc.name} is missing): "
             "pip install 'geir[models]'")

import geir
from geir.ir._dot import graph_to_dot, render
from geir.ir._files import write_file
from geir.tools.model_scopes import common_scope, node_scopes
from geir.tools.onnx_import import read_onnx

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, max_position_embeddings=64, attn_implementation="eager")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
           experts_implementation="batched_mm")


class Decoder(torch.nn.Module):
    """A transformers base model from its input embeddings to its last hidden state (no vocabulary lookup)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x, use_cache=False).last_hidden_state


class Attention(torch.nn.Module):
    """Llama's attention layer with its rotary embedding and a causal mask, from hidden states to hidden states."""

    def __init__(self, config: transformers.LlamaConfig) -> None:
        super().__init__()
        from transformers.models.llama import modeling_llama

        self.rotary_emb = modeling_llama.LlamaRotaryEmbedding(config)
        self.self_attn = modeling_llama.LlamaAttention(config, layer_idx=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        cos, sin = self.rotary_emb(x, torch.arange(seq).unsqueeze(0))
        mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
        return self.self_attn(x, (cos, sin), mask)[0]


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama_block": lambda: Decoder(transformers.LlamaModel(transformers.LlamaConfig(**SMALL))),
    "moe_block": lambda: Decoder(transformers.Qwen2MoeModel(transformers.Qwen2MoeConfig(**SMALL, **MOE))),
    "attention_block": lambda: Attention(transformers.LlamaConfig(**SMALL)),
}


def export(name: str, path: Path) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = MODELS[name]().eval()
        shapes = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)
        torch.onnx.export(module, (torch.randn(2, 5, SMALL["hidden_size"]),), str(path), dynamo=True,
                          external_data=False, dynamic_shapes=shapes, input_names=["x"], output_names=["y"],
                          verbose=False)


def fused_scopes(report: geir.FusionReport, scopes: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Each fused node in the module the nodes it replaced share (the longest common scope)."""
    placed = dict(scopes)
    for match in report.fused:          # became: "<OpType> '<node name>'"
        placed[match.became.split("'", 1)[1][:-1]] = common_scope([scopes.get(name, ()) for name in match.replaced])
    return placed


def draw(graph: geir.Graph, scopes: dict[str, tuple[str, ...]], stem: Path) -> list[str]:
    """The picture of ``graph`` as SVG and PNG (DOT text without Graphviz); the files written."""
    if shutil.which("dot") is None:
        write_file(stem.with_suffix(".dot"), graph_to_dot(graph, scopes))
        return [stem.with_suffix(".dot").name]
    written = []
    for fmt in ("svg", "png"):
        notes: list[str] = []
        write_file(stem.with_suffix(f".{fmt}"), render(graph, fmt, scopes, notes))
        written.append(stem.with_suffix(f".{fmt}").name + "".join(f" ({n})" for n in notes))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the .onnx files and the pictures")
    parser.add_argument("--model", choices=sorted(MODELS), action="append", help="draw only this one (repeatable)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if shutil.which("dot") is None:
        print("Graphviz's dot is not on PATH (apt-get install graphviz): writing DOT text instead of SVG/PNG")
    for name in args.model or list(MODELS):
        path = out / f"{name}.onnx"
        export(name, path)
        proto = read_onnx(path)
        scopes = node_scopes(proto)
        graph = geir.load_onnx(path)
        fused, report = geir.fuse(graph)
        print(f"{name}: {len(graph.nodes)} nodes, {len(graph.constant_values)} constants; fused: "
              f"{len(fused.nodes)} nodes ({len(report.fused)} matches)")
        for stem, drawn, placed in ((name, graph, scopes), (f"{name}_fused", fused, fused_scopes(report, scopes))):
            print(f"  wrote {', '.join(draw(drawn, placed, out / stem))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
