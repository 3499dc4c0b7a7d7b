"""geir.fuse on tiny Hugging Face transformers models nobody here wrote, exported by both of torch's exporters with
static and dynamic shapes: what fuses is the table below (a regression in either direction fails), every site that
does not fuse is a near miss with its reason, and the fused graph computes what the original did on both runtimes.

The table is float32 (the rope and the MoE combine); SparseFlashAttention takes float16/bfloat16 only, so DeepSeek-V3.2's
top-k selection is checked on a float16 export (its float32 one is a near miss naming the dtype)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import geir

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test,models]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test,models]')")

from real_models import BROKEN_EXPORTS, EXPORTER_FAILS, FAMILIES, HIDDEN, export, model  # noqa: E402  (needs torch)

pytestmark = [pytest.mark.slow, pytest.mark.models]

ROPE, MOE, SFA = "InplacePartialRotaryMul", "MoeTokenUnpermute", "SparseFlashAttention"

SITES = {"llama": (2, 0), "mistral": (2, 0), "qwen2": (2, 0), "qwen3": (2, 0), "gemma2": (2, 0), "gptj": (4, 0),
         "gpt_neox": (4, 0), "phi": (4, 0), "cohere": (2, 0), "mixtral": (2, 1), "qwen2_moe": (2, 1),
         "qwen3_moe": (2, 1), "olmoe": (2, 1), "deepseek_v3": (3, 1), "deepseek_v32": (7, 1), "gpt_oss": (2, 1)}
"""Per family, the rope sites (q and k, MLA's q and shared key, DeepSeek-V3.2's indexer) and MoE combines a float32
export fuses to when every site fuses (Mixtral's is its per-expert loop, which only TorchScript can export)."""

FEWER: dict[tuple[str, str, str], tuple[dict[str, int], str | None]] = {
    **{("deepseek_v3", "torchscript", shapes): ({ROPE: 2}, None) for shapes in ("static", "dynamic")},
}
"""Where fewer of our ops than ``SITES``: the counts, and the near miss that says why (None: none, as every site fused:
TorchScript writes DeepSeek-V3's ropes as two sites, dynamo as three)."""


def _fused_counts(report: geir.FusionReport) -> dict[str, int]:
    return dict(collections.Counter(f.became.split(" ")[0] for f in report.fused))


def _equal_on_both_runtimes(original, fused, x, tolerance):
    for runtime in ("numpy", "onnxruntime"):
        want = geir.run(original, {"x": x}, runtime=runtime)["y"].astype(np.float64)
        got = geir.run(fused, {"x": x}, runtime=runtime)["y"].astype(np.float64)
        assert np.abs(got - want).max() <= tolerance * np.abs(want).max(), runtime


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fusion_of_a_whole_exported_model(family, exporter, shapes, tmp_path):
    case = (family, exporter, shapes)
    if case in EXPORTER_FAILS or case in BROKEN_EXPORTS:
        pytest.skip("no export to fuse (test_grad_of_real_models proves why)")
    path = tmp_path / f"{family}.onnx"
    export(model(family, torch.float32), path, exporter, shapes == "dynamic", torch.float32)
    original = geir.from_onnx(path, symbolic_shapes=True)
    fused, report = geir.fuse(original, allow_stricter_data=True)
    rope, moe = SITES[family]
    counts, reason = FEWER.get(case, ({}, ""))
    expected = {op: n for op, n in ({ROPE: rope, MOE: moe} | counts).items() if n}
    assert _fused_counts(report) == expected, report
    assert all(m.reason for m in report.near_misses)
    if reason is not None:
        assert any(reason in m.reason for m in report.near_misses), report
    rng = np.random.default_rng(0)
    for batch, seq in [(2, 5)] + ([(3, 7)] if shapes == "dynamic" else []):
        _equal_on_both_runtimes(original, fused, rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32), 1e-4)


def test_deepseek_v32_top_k_selection_fuses_to_sparse_flash_attention(tmp_path):
    """DeepSeek-V3.2's indexer picks 3 of 7 keys per query row; its float16 static export fuses the masked dense
    attention to one causal SparseFlashAttention (the MoE combine and the ropes fuse beside it), and the fused model
    computes what the original did on both runtimes; so does its dynamic export, whose causal mask is computed from
    the input's shape (read as key position <= query position of one Range), at other lengths too."""
    module = model("deepseek_v32", torch.float16, index_topk=3)
    for shapes in ("static", "dynamic"):
        path = tmp_path / f"{shapes}.onnx"
        export(module, path, "dynamo", shapes == "dynamic", torch.float16, seq=7)
        original = geir.from_onnx(path, symbolic_shapes=True)
        fused, report = geir.fuse(original, allow_stricter_data=True)
        attention = [n for n in fused.nodes if n.op_type == SFA]
        assert len(attention) == 1 and attention[0].attributes["sparse_mode"] == 3, report
        _, strict = geir.fuse(original)
        assert any("skips a key the mask hides" in m.reason for m in strict.near_misses), strict
        for batch, seq in [(2, 7)] + ([(1, 9), (3, 2)] if shapes == "dynamic" else []):
            x = np.random.default_rng(0).standard_normal((batch, seq, HIDDEN)).astype(np.float16)
            _equal_on_both_runtimes(original, fused, x, 2e-3)
