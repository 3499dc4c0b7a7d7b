"""geir.grad of whole transformers that nobody here wrote: tiny Hugging Face models (random weights from configs,
no hub), exported by both of torch's ONNX exporters (TorchScript at opset 17, dynamo at opset 18), static and with
dynamic batch and sequence, differentiated with respect to their input embeddings and checked against
torch.autograd on both runtimes (and, where the model computes in float64 throughout, against float64 central
differences).

Needs torch, transformers and onnxscript (``pip install -e ".[test,models]"``); skips, saying which is missing,
without them. Marked slow and models: ``.ci/run`` installs the extra and runs ``pytest -m models``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import geir
from helpers import directional_error

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test,models]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e "
                                                          "'.[test,models]')")

pytestmark = [pytest.mark.slow, pytest.mark.models]

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

FLOAT64_THROUGHOUT = ("gptj", "gpt_neox", "phi")
"""Families whose code computes in the model's dtype everywhere (the others' RMSNorm casts to float32), so float64
central differences of the exported graph are exact to 1e-6."""

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


ONNX_RUNTIME_LACKS = {"gpt_neox": "implementation for Erf"}
"""Families whose float64 model ONNX Runtime cannot run, forward or derivative (it has no float64 Erf kernel)."""


class Embedded(torch.nn.Module):
    """The model from its input embeddings (a full attention mask, as users pass one) to its last hidden state."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[:2], dtype=torch.long)
        return self.model(inputs_embeds=x, attention_mask=mask, use_cache=False).last_hidden_state


def _model(family: str) -> torch.nn.Module:
    stem, config = FAMILIES[family]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = getattr(transformers, f"{stem}Config")(**config)
        return Embedded(getattr(transformers, f"{stem}Model")(made).eval().double())


def _export(module: torch.nn.Module, path: Path, exporter: str, dynamic: bool) -> None:
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
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


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grad_of_a_whole_exported_model_matches_torch_autograd(family, exporter, shapes, tmp_path):
    module = _model(family)
    path = tmp_path / f"{family}.onnx"
    case = (family, exporter, shapes)
    if case in EXPORTER_FAILS:
        with pytest.raises(Exception):
            _export(module, path, exporter, shapes == "dynamic")
        pytest.skip(f"torch cannot export it: {EXPORTER_FAILS[case]}")
    _export(module, path, exporter, shapes == "dynamic")
    if case in BROKEN_EXPORTS:
        with pytest.raises(geir.GraphError, match=BROKEN_EXPORTS[case]):
            geir.from_onnx(path)
        return
    graph = geir.from_onnx(path)
    derivative = geir.grad(graph, wrt=["x"])
    cotangent = derivative.inputs[len(graph.inputs)].name
    rng = np.random.default_rng(1)
    for batch, seq in [(2, 5)] + ([(3, 7), (1, 2)] if shapes == "dynamic" else []):
        x = rng.standard_normal((batch, seq, HIDDEN)) * 0.5
        u = rng.standard_normal((batch, seq, HIDDEN))
        got = geir.run(derivative, {"x": x, cotangent: u}, runtime="numpy")
        xt = torch.tensor(x, requires_grad=True)
        y = module(xt)
        y.backward(torch.from_numpy(u))
        want = xt.grad.numpy()
        np.testing.assert_allclose(got["y"], y.detach().numpy(), rtol=1e-5, atol=1e-6 * np.abs(want).max())
        error = np.abs(got["grad_x"] - want).max() / np.abs(want).max()
        assert error < 1e-5, (family, exporter, shapes, (batch, seq), error)
        if (batch, seq) == (2, 5) and family in ONNX_RUNTIME_LACKS:
            with pytest.raises(geir.GraphError, match=ONNX_RUNTIME_LACKS[family]):
                geir.run(derivative, {"x": x, cotangent: u}, runtime="onnxruntime")
        elif (batch, seq) == (2, 5):          # the other runtime runs the derivative too
            on_ort = geir.run(derivative, {"x": x, cotangent: u}, runtime="onnxruntime")
            assert np.abs(on_ort["grad_x"] - want).max() / np.abs(want).max() < 1e-5, (family, "onnxruntime")
    if family in FLOAT64_THROUGHOUT and shapes == "static":
        feeds = {"x": rng.standard_normal((2, 5, HIDDEN)) * 0.5}
        assert directional_error(graph, feeds) < 1e-6
