"""``geir bench models``: fused against unfused on blocks of real model code (issue 26, item 3).

Three one-layer transformers models built by ``transformers`` from configs (random weights, no hub), exported by
torch's dynamo exporter with static shapes: a Llama block (its ropes fuse), a DeepSeek-V3 MoE block (ropes and the
MoE combine) and a DeepSeek-V3.2 attention block in float16 (ropes, MoE and the top-k selection ->
SparseFlashAttention). Each is timed as a plain ONNX Runtime session of the exported file, through geir unfused and
fused on both runtimes, and as PyTorch eager; the fused graph is held to at most the unfused one's time on the same
runtime. Needs torch and transformers (``pip install -e ".[models]"``); without them the suite has no rows.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .bench_onnx import RUN_TARGET, _session_run
from .bench_rows import Measurement
from .facade import fuse, run
from .onnx_import import from_onnx

__all__ = ["embedded", "model_measurements", "models_available"]

_COMMON = dict(num_hidden_layers=1, vocab_size=64, max_position_embeddings=4096, attn_implementation="eager")
_MLA = dict(n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=32,
            qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=0, n_group=1, topk_group=1,
            experts_implementation="batched_mm")
BLOCKS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("Llama block", "Llama", dict(num_attention_heads=8, num_key_value_heads=4), "float32"),
    ("DeepSeek-V3 MoE block", "DeepseekV3", dict(_MLA, num_attention_heads=4, num_key_value_heads=4,
                                                  moe_intermediate_size=256), "float32"),
    ("DeepSeek-V3.2 attention block", "DeepseekV32", dict(_MLA, num_attention_heads=4, num_key_value_heads=4,
                                                          moe_intermediate_size=256, head_dim=32, index_topk=32,
                                                          index_head_dim=64, index_n_heads=2), "float16"),
)
"""(case, transformers class stem, config, dtype) of each block; hidden 256, intermediate 512."""


def models_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def embedded(model: Any) -> Any:
    """``model`` (a transformers base model) as a module from its input embeddings, with a full attention mask as
    users pass one, to its last hidden state: what the exports time and the real-model tests differentiate."""
    import torch

    class Embedded(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(x.shape[:2], dtype=torch.long)
            return self.model(inputs_embeds=x, attention_mask=mask, use_cache=False).last_hidden_state

    return Embedded(model)


def _export(stem: str, config: dict[str, Any], dtype: str, shape: tuple[int, int, int], path: Path) -> Any:
    """The block as a module from its input embeddings to its last hidden state, exported to ``path``."""
    import torch
    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = getattr(transformers, f"{stem}Config")(hidden_size=shape[-1], intermediate_size=512,
                                                      **{**_COMMON, **config})
        module = embedded(getattr(transformers, f"{stem}Model")(made).eval().to(getattr(torch, dtype)))
        x = torch.randn(*shape, dtype=getattr(torch, dtype))
        torch.onnx.export(module, (x,), str(path), dynamo=True, external_data=False, opset_version=18,
                          input_names=["x"], output_names=["y"], verbose=False)
    return module


def _block_rows(case: str, stem: str, config: dict[str, Any], dtype: str, shape: tuple[int, int, int],
                folder: Path) -> list[Measurement]:
    import torch

    path = folder / f"{stem}.onnx"
    module = _export(stem, config, dtype, shape, path)
    unfused = from_onnx(path)
    fused, report = fuse(unfused, allow_stricter_data=True)
    ops = ", ".join(sorted({f.became.split(" ")[0] for f in report.fused})) or "nothing"
    case = f"{case}, {list(shape)} {dtype}, fused: {ops}"
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    feeds = {"x": x}
    rows = [Measurement("model block", case, "plain InferenceSession.run", _session_run(onnx.load(str(path)), feeds),
                        1e9, "calls/s", baseline=True)]
    for runtime in ("numpy", "onnxruntime"):
        for graph in (unfused, fused):
            run(graph, feeds, runtime=runtime)                  # compiled once, as a user's first call does
        unfused_name = f"geir.run {runtime}, unfused"
        rows.append(Measurement("model block", case, unfused_name,
                                lambda runtime=runtime: run(unfused, feeds, runtime=runtime), 1e9, "calls/s",
                                targets=(("plain InferenceSession.run", RUN_TARGET),) if runtime == "onnxruntime"
                                else ()))
        rows.append(Measurement("model block", case, f"geir.run {runtime}, fused",
                                lambda runtime=runtime: run(fused, feeds, runtime=runtime), 1e9, "calls/s",
                                targets=((unfused_name, 1.0),)))
    tensor = torch.from_numpy(x)

    def eager() -> object:
        with torch.no_grad():
            return module(tensor)
    rows.append(Measurement("model block", case, "PyTorch eager", eager, 1e9, "calls/s"))
    return rows


def model_measurements(quick: bool) -> list[Measurement]:
    """Fused against unfused on Llama, MoE and attention blocks of real model code (needs the models extra)."""
    if not models_available():
        return []
    shape = (1, 32, 256) if quick else (2, 128, 256)
    folder = Path(tempfile.mkdtemp(prefix="geir-bench-models-"))
    rows: list[Measurement] = []
    for case, stem, config, dtype in BLOCKS:
        rows += _block_rows(case, stem, config, dtype, shape, folder)
    return rows
