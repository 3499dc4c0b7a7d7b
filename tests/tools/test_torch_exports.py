"""Dynamic exports of a real model (a tiny Hugging Face BERT, random weights) by both PyTorch exporters import
with the static sizes the file and ONNX's inference know, and run on both runtimes at shapes other than the traced
one (issue 25)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

import geir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.models]


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).last_hidden_state

    return Hidden().eval()


def _export(module: torch.nn.Module, path: str, dynamo: bool) -> None:
    ids = torch.randint(0, 64, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            pytest.importorskip("onnxscript")
            torch.onnx.export(module, (ids,), path, dynamo=True, external_data=False, input_names=["ids"],
                              output_names=["hidden"], dynamic_shapes={"ids": {0: "batch", 1: "seq"}})
        else:
            torch.onnx.export(module, (ids,), path, dynamo=False, input_names=["ids"], output_names=["hidden"],
                              dynamic_axes={"ids": {0: "batch", 1: "seq"}, "hidden": {0: "batch", 1: "seq"}},
                              opset_version=17)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_dynamic_bert_exports_keep_static_sizes_and_run_on_both_runtimes(tmp_path, dynamo):
    module = _bert()
    path = str(tmp_path / "bert.onnx")
    _export(module, path, dynamo)
    model = onnx.load(path)
    graph = geir.load_onnx(path)
    standard = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert {n.version for n in graph.nodes if n.domain == ""} == {standard}     # kept, not converted
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    stated = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in list(inferred.graph.value_info) + list(model.graph.value_info)
              if vi.type.tensor_type.HasField("shape")}
    values = {v.name: v for v in graph.values()}
    kept = 0
    for name, dims in stated.items():
        if name not in values:
            continue
        ours = values[name].type
        assert ours.has_rank and len(ours.shape) == len(dims), (name, ours, dims)
        for ours_dim, size in zip(ours.shape, dims):
            if size is not None:
                assert ours_dim == size, (name, ours, dims)
                kept += 1
    assert kept > 50
    assert values["hidden"].type.shape[2] == 32
    for shape in ((3, 9), (1, 4)):
        ids = np.random.default_rng(sum(shape)).integers(0, 64, shape)
        want = module(torch.from_numpy(ids)).detach().numpy()
        for runtime in ("numpy", "onnxruntime"):
            got = geir.run(graph, {"ids": ids}, runtime=runtime)["hidden"]
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"{runtime} {shape}")
