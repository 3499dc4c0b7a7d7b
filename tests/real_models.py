"""Tiny Hugging Face transformers models of sixteen families (random weights from configs, no hub) and their ONNX
exports by both of torch's exporters: what the real-model tests of grad and fusion share. Import it after
``pytest.importorskip`` of torch and transformers."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers

from geir.tools.bench_models import embedded

HIDDEN = 32
SMALL = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, attn_implementation="eager")
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           experts_implementation="batched_mm")
MLA = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=16,
           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=0, n_group=1, topk_group=1,
           num_key_value_heads=4, experts_implementation="batched_mm")

FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("Llama", SMALL),
    "mistral": ("Mistral", SMALL),
    "qwen2": ("Qwen2", SMALL),
    "qwen3": ("Qwen3", SMALL),
    "gemma2": ("Gemma2", {**SMALL, "head_dim": 8}),
    "gptj": ("GPTJ", dict(n_embd=HIDDEN, n_layer=1, n_head=4, vocab_size=64, n_positions=64, rotary_dim=4,
                          attn_implementation="eager")),
    "gpt_neox": ("GPTNeoX", SMALL),
    "phi": ("Phi", SMALL),
    "cohere": ("Cohere", SMALL),
    "mixtral": ("Mixtral", {**SMALL, **MOE, "experts_implementation": "eager"}),    # the per-expert loop
    "qwen2_moe": ("Qwen2Moe", {**SMALL, **MOE}),
    "qwen3_moe": ("Qwen3Moe", {**SMALL, **MOE}),
    "olmoe": ("Olmoe", {**SMALL, **MOE}),
    "deepseek_v3": ("DeepseekV3", {**SMALL, **MLA}),
    # index_topk covers every key at these lengths: the indexer's scores pass a ReLU, so keys tie at 0, and which of
    # the tied keys a top-k keeps differs between torch and any other engine (both right)
    "deepseek_v32": ("DeepseekV32", {**SMALL, **MLA, "head_dim": 8, "index_topk": 8, "index_head_dim": 16,
                                     "index_n_heads": 2}),
    "gpt_oss": ("GptOss", {**SMALL, **MOE, "head_dim": 8}),
}
"""Each family: its class-name stem and a tiny config (one layer, 32 wide; MoE with 4 experts, top 2)."""


EXPORTER_FAILS = {
    ("cohere", "torchscript", "static"): "TorchScript's exporter asserts in its Expand shape inference",
    ("deepseek_v32", "torchscript", "static"): "TorchScript's exporter has no aten::scatter with a bool value",
    ("deepseek_v32", "torchscript", "dynamic"): "TorchScript's exporter has no aten::scatter with a bool value",
    ("mixtral", "dynamo", "static"): "torch.export cannot trace the per-expert loop's data-dependent shapes",
    ("mixtral", "dynamo", "dynamic"): "torch.export cannot trace the per-expert loop's data-dependent shapes",
}
"""Exports torch itself cannot make (checked: the exporter raises). Each is a torch limitation, not geir's."""

BROKEN_EXPORTS = {
    ("cohere", "torchscript", "dynamic"): "Incompatible dimensions",
}
"""Exports torch makes but which are wrong (ONNX Runtime fails on them too, ONNX's strict inference refuses them):
geir must refuse them at import with a GraphError, never run them."""



def model(family: str, dtype: torch.dtype = torch.float64, **changes: object) -> torch.nn.Module:
    """The family's tiny model in ``dtype``, its config with ``changes``."""
    stem, config = FAMILIES[family]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = getattr(transformers, f"{stem}Config")(**{**config, **changes})
        return embedded(getattr(transformers, f"{stem}Model")(made).eval().to(dtype))


def export(module: torch.nn.Module, path: Path, exporter: str, dynamic: bool, dtype: torch.dtype = torch.float64,
            seq: int = 5) -> None:
    x = torch.randn(2, seq, HIDDEN, dtype=dtype)
    names = dict(input_names=["x"], output_names=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            pytest.importorskip("onnxscript", reason="onnxscript (torch's dynamo exporter) is not installed")
            shapes = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},) if dynamic else None
            torch.onnx.export(module, (x,), str(path), dynamo=True, external_data=False, opset_version=18,
                              dynamic_shapes=shapes, verbose=False, **names)
        else:
            axes = {"x": {0: "batch", 1: "seq"}} if dynamic else None
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17, dynamic_axes=axes, **names)
