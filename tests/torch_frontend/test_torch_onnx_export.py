"""geir.torch's ONNX export: modules calling its ops export through torch's dynamo exporter as ``ai.cann`` nodes that
geir imports, node for node, and the imported graph computes what the module computes, on both runtimes."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import geir  # noqa: E402
import geir.torch as gt  # noqa: E402
from geir.tools.torch._bridge import to_numpy, to_torch  # noqa: E402

from sparse_attention.helpers import AttentionCase  # noqa: E402
from .helpers import bits  # noqa: E402

pytestmark = pytest.mark.models   # torch's exporter takes seconds per model

RUNTIMES = ("numpy", "onnxruntime")


def _exported(module: torch.nn.Module, args: tuple, in_place: bool = False) -> onnx.ModelProto:
    if in_place:
        return gt.export_onnx(module, args)
    with warnings.catch_warnings():   # torch's own deprecations inside its exporter
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module.eval(), args, dynamo=True, verbose=False,
                                    custom_translation_table=gt.onnx_translation_table())
    return program.model_proto


_TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3}


def _check(module: torch.nn.Module, args: tuple, cann_ops: list[str], in_place: bool = False) -> None:
    """Export, import, and compare every output with the module's own: bit for bit on the NumPy runtime (the same
    kernels), within the dtype's rounding on ONNX Runtime (its native kernels sum in another order)."""
    with torch.no_grad():
        expected = module(*[a.clone() for a in args])
    expected = expected if isinstance(expected, tuple) else (expected,)
    model = _exported(module, args, in_place)
    assert sorted(n.op_type for n in model.graph.node if n.domain == "ai.cann") == sorted(cann_ops)
    graph = geir.from_onnx(model)
    feeds = {v.name: to_numpy(a, v.name) for v, a in zip(graph.inputs, args)}
    for runtime in RUNTIMES:
        results = geir.run(graph, feeds, runtime=runtime)
        assert len(results) == len(expected)
        for value, want in zip(graph.outputs, expected):
            got = results[value.name]
            assert got.shape == tuple(want.shape), (runtime, value.name)
            if runtime == "numpy" or got.dtype not in _TOLERANCE:
                assert np.array_equal(bits(got), bits(want)), (runtime, value.name)
            else:
                tolerance = _TOLERANCE[got.dtype]
                np.testing.assert_allclose(got.astype(np.float64), want.double().numpy(), rtol=tolerance,
                                           atol=tolerance, err_msg=f"{runtime} {value.name}")


def _routing(tokens: int = 6, topk: int = 2, hidden: int = 8, experts: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(torch.int32)
    return x, ids, torch.rand(tokens, topk, generator=g)


class _PermuteUnpermute(torch.nn.Module):
    def __init__(self, with_probs: bool) -> None:
        super().__init__()
        self.with_probs = with_probs

    def forward(self, x, ids, probs):
        rows, sorted_indices = gt.npu_moe_token_permute(x, ids)
        return gt.npu_moe_token_unpermute(rows * 2, sorted_indices, probs if self.with_probs else None)


@pytest.mark.parametrize("with_probs", [True, False])
def test_a_moe_combine_exports_as_permute_and_unpermute_nodes(with_probs):
    x, ids, probs = _routing(topk=2 if with_probs else 1)
    _check(_PermuteUnpermute(with_probs), (x, ids, probs), ["MoeTokenPermute", "MoeTokenUnpermute"])


class _UnpermuteGrad(torch.nn.Module):
    def __init__(self, rows: int | None, with_probs: bool) -> None:
        super().__init__()
        self.rows, self.with_probs = rows, with_probs

    def forward(self, rows, grad, sorted_indices, probs):
        probs = probs if self.with_probs else None
        if self.rows is None:   # the first grad op: rows given whole
            return gt.npu_moe_token_unpermute_grad(rows, grad, sorted_indices, probs)
        return gt.npu_moe_token_unpermute_grad_v2(grad, sorted_indices, self.rows, rows.dtype, probs,
                                                  permuted_tokens=rows[:self.rows] if self.with_probs else None)


@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("dropped", [None, 0, 3], ids=["grad", "v2", "v2-dropped-rows"])
def test_unpermute_grads_export_with_torch_npus_conventions(dropped, with_probs):
    """v2 with rows the forward dropped (pads then slices around the node) and without probs (a 0-d probs grad)."""
    x, ids, probs = _routing(topk=2 if with_probs else 1)
    rows, sorted_indices = gt.npu_moe_token_permute(x, ids)
    grad = torch.randn(x.shape[0], x.shape[1])
    module = _UnpermuteGrad(None if dropped is None else rows.shape[0] - dropped, with_probs)
    _check(module, (rows, grad, sorted_indices, probs), ["MoeTokenUnpermuteGrad"])


class _PermuteGrad(torch.nn.Module):
    def forward(self, grad, sorted_indices):
        return gt.npu_moe_token_permute_grad_v2(grad, sorted_indices, 6, grad.dtype, 2)


@pytest.mark.parametrize("trailing", [(8,), (2, 4)], ids=["2d", "3d"])
def test_the_permute_grad_exports_with_trailing_dims_flattened_around_it(trailing):
    x, ids, _ = _routing()
    _, sorted_indices = gt.npu_moe_token_permute(x, ids)
    grad = torch.randn(12, *trailing)
    _check(_PermuteGrad(), (grad, sorted_indices), ["MoeTokenPermuteGrad"])


class _Attention(torch.nn.Module):
    def __init__(self, case: AttentionCase, with_stats: bool) -> None:
        super().__init__()
        self.case, self.with_stats = case, with_stats

    def forward(self, query, key, value, indices, query_rope, key_rope):
        case = self.case
        return gt.npu_sparse_flash_attention(query, key, value, indices, case.scale, query_rope=query_rope,
                                             key_rope=key_rope, sparse_block_size=case.bs,
                                             return_softmax_lse=self.with_stats)


class _AttentionGrad(torch.nn.Module):
    def __init__(self, case: AttentionCase) -> None:
        super().__init__()
        self.case = case

    def forward(self, query, key, value, indices, d_out, out, row_max, row_sum, query_rope, key_rope):
        return gt.npu_sparse_flash_attention_grad(query, key, value, indices, d_out, out, row_max, row_sum,
                                                  self.case.scale, self.case.bs, query_rope, key_rope)


def _attention_args(rope: int):
    case = AttentionCase(layout="BSND", dtype="float16", Dr=rope, N1=4, N2=2, bs=2, seed=3)
    arrays = case.arrays()
    t = {k: None if v is None else to_torch(np.ascontiguousarray(v).copy()) for k, v in arrays.items()}
    return case, t


@pytest.mark.parametrize("with_stats", [True, False])
@pytest.mark.parametrize("rope", [0, 4])
def test_sparse_attention_exports_as_one_node_with_torch_npus_outputs(rope, with_stats):
    case, t = _attention_args(rope)
    args = (t["query"], t["key"], t["value"], t["sparse_indices"], t["query_rope"], t["key_rope"])
    if not rope:   # absent optional inputs are not graph inputs: export a module without them
        module: torch.nn.Module = _NoRope(_Attention(case, with_stats))
        args = args[:4]
    else:
        module = _Attention(case, with_stats)
    _check(module, args, ["SparseFlashAttention"])


class _NoRope(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args, None, None)


@pytest.mark.parametrize("rope", [0, 4])
def test_the_attention_grad_exports_with_empty_rope_grads_when_there_is_no_rope(rope):
    case, t = _attention_args(rope)
    out, row_max, row_sum = gt.npu_sparse_flash_attention(
        t["query"], t["key"], t["value"], t["sparse_indices"], case.scale, query_rope=t["query_rope"],
        key_rope=t["key_rope"], sparse_block_size=case.bs, return_softmax_lse=True)
    d_out = torch.randn(out.shape).to(out.dtype)
    args = (t["query"], t["key"], t["value"], t["sparse_indices"], d_out, out, row_max, row_sum,
            t["query_rope"], t["key_rope"])
    module: torch.nn.Module = _AttentionGrad(case)
    if not rope:
        module, args = _NoRope(module), args[:8]
    _check(module, args, ["SparseFlashAttentionGrad"])


class _Rotary(torch.nn.Module):
    def __init__(self, mode: str, in_place: bool) -> None:
        super().__init__()
        self.mode, self.in_place = mode, in_place

    def forward(self, x, cos, sin, dy):
        if self.in_place:
            x, dy = x * 1, dy * 1   # rotate new tensors in place, as model code does
            gt.inplace_partial_rotary_mul(x, cos, sin, rotary_mode=self.mode, partial_slice=[0, 16])
            gt.inplace_partial_rotary_mul_backward(dy, cos, sin, rotary_mode=self.mode, partial_slice=[0, 16])
            return x, dy
        return (gt.partial_rotary_mul(x, cos, sin, rotary_mode=self.mode, partial_slice=[0, 16]),
                gt.partial_rotary_mul_backward(dy, cos, sin, rotary_mode=self.mode, partial_slice=[0, 16]))


@pytest.mark.parametrize("in_place", [False, True], ids=["functional", "in-place"])
@pytest.mark.parametrize("mode", list(gt.ROTARY_MODES))
def test_rotary_exports_in_each_mode_in_place_through_export_onnx(mode, in_place):
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, 4, 2, 24, generator=g), torch.randn(2, 4, 2, 24, generator=g)
    cos, sin = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 4, 1, 16, generator=g)
    _check(_Rotary(mode, in_place), (x, cos, sin, dy),
           ["InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"], in_place=in_place)


class _RotateAView(torch.nn.Module):
    def forward(self, x, cos, sin):
        x = x * 1
        gt.inplace_partial_rotary_mul(x[..., :16], cos, sin, rotary_mode="half", partial_slice=[0, 16])
        return x


def test_an_in_place_rotation_of_a_view_is_refused_with_the_reason():
    x, cos, sin = torch.randn(1, 4, 1, 24), torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
    with pytest.raises(geir.GraphError, match="rotates a view of a larger tensor"):
        gt.export_onnx(_RotateAView(), (x, cos, sin))


def test_an_unknown_rotary_mode_is_rp_s4_at_export():
    x, cos, sin = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
    module = _Rotary("half", False)
    module.mode = "sideways"
    with pytest.raises(Exception, match="RP-S4"):
        _exported(module, (x, cos, sin, x.clone()))


def test_export_onnx_writes_the_file_and_to_graph_gives_the_graph(tmp_path):
    x, ids, probs = _routing()
    path = tmp_path / "moe.onnx"
    model = gt.export_onnx(_PermuteUnpermute(True), (x, ids, probs), path=path)
    assert onnx.load(path) == model
    assert [p.name for p in tmp_path.iterdir()] == ["moe.onnx"]   # no temporary file left behind
    graph = gt.to_graph(_PermuteUnpermute(True), (x, ids, probs))
    assert [n.op_type for n in graph.nodes if n.domain == "ai.cann"] == ["MoeTokenPermute", "MoeTokenUnpermute"]


def test_npu_style_code_through_the_shim_exports_unchanged():
    """Model code written for the NPU (``import torch_npu`` in forward) exports to the same ai.cann nodes."""

    class NpuCombine(torch.nn.Module):
        def forward(self, x, ids, probs):
            import torch_npu
            rows, sorted_indices = torch_npu.npu_moe_token_permute(x, ids)
            return torch_npu.npu_moe_token_unpermute(rows * 2, sorted_indices, probs)

    x, ids, probs = _routing()
    with gt.npu_shim():
        _check(NpuCombine(), (x, ids, probs), ["MoeTokenPermute", "MoeTokenUnpermute"])
