"""``geir bench models`` measures what it says: the three blocks of real model code fuse to the ops their case
names, the fused graph computes what the unfused one does on both runtimes, and each fused row is held to the
unfused row of its runtime. Without torch and transformers the suite has no rows and says why. Times are the
benchmark's business, never asserted here."""

from __future__ import annotations

import numpy as np
import pytest

from geir.tools import bench, bench_models


def test_without_torch_and_transformers_the_suite_says_why(monkeypatch):
    monkeypatch.setattr(bench_models, "models_available", lambda: False)
    monkeypatch.setattr(bench, "models_available", lambda: False)
    assert bench_models.model_measurements(quick=True) == []
    table = bench.run_benchmarks(["models"], quick=True, repeat=1, progress=None)
    assert "models: no rows, it needs torch and transformers" in table


@pytest.mark.slow
@pytest.mark.models
def test_model_block_rows_compare_fused_with_unfused_on_each_runtime():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test,models]')")
    pytest.importorskip("onnxscript", reason="onnxscript (torch's dynamo exporter) is not installed")
    rows = bench_models.model_measurements(quick=True)
    cases = list(dict.fromkeys(r.case for r in rows))
    assert [c.split(",")[0] for c in cases] == ["Llama block", "DeepSeek-V3 MoE block", "DeepSeek-V3.2 attention block"]
    assert cases[2].endswith("fused: InplacePartialRotaryMul, MoeTokenUnpermute, SparseFlashAttention")
    for case in cases:
        named = {r.name: r for r in rows if r.case == case}
        for runtime in ("numpy", "onnxruntime"):
            fused = named[f"geir.run {runtime}, fused"]
            assert fused.targets == ((f"geir.run {runtime}, unfused", 1.0),)
            want = named[f"geir.run {runtime}, unfused"].fn()["y"].astype(np.float64)
            got = fused.fn()["y"].astype(np.float64)
            assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max(), (case, runtime)
