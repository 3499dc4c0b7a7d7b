"""geir.grad of whole transformers that nobody here wrote: tiny Hugging Face models (random weights from configs,
no hub), exported by both of torch's ONNX exporters (TorchScript at opset 17, dynamo at opset 18), static and with
dynamic batch and sequence, differentiated with respect to their input embeddings and checked against
torch.autograd on both runtimes (and, where the model computes in float64 throughout, against float64 central
differences).

Needs torch, transformers and onnxscript (``pip install -e ".[test,models]"``); skips, saying which is missing,
without them. Marked slow and models: ``.ci/run`` installs the extra and runs ``pytest -m models``.
"""

from __future__ import annotations

import numpy as np
import pytest

import geir
from helpers import directional_error

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test,models]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e "
                                                          "'.[test,models]')")

from real_models import BROKEN_EXPORTS, EXPORTER_FAILS, FAMILIES, HIDDEN, export, model  # noqa: E402  (needs torch)

pytestmark = [pytest.mark.slow, pytest.mark.models]

FLOAT64_THROUGHOUT = ("gptj", "gpt_neox", "phi")
"""Families whose code computes in the model's dtype everywhere (the others' RMSNorm casts to float32), so float64
central differences of the exported graph are exact to 1e-6."""

ONNX_RUNTIME_LACKS = {"gpt_neox": "implementation for Erf"}
"""Families whose float64 model ONNX Runtime cannot run, forward or derivative (it has no float64 Erf kernel)."""


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grad_of_a_whole_exported_model_matches_torch_autograd(family, exporter, shapes, tmp_path):
    module = model(family)
    path = tmp_path / f"{family}.onnx"
    case = (family, exporter, shapes)
    if case in EXPORTER_FAILS:
        with pytest.raises(Exception):
            export(module, path, exporter, shapes == "dynamic")
        pytest.skip(f"torch cannot export it: {EXPORTER_FAILS[case]}")
    export(module, path, exporter, shapes == "dynamic")
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
