"""geir.fuse: every pattern and the variants exporters emit become our op (the report says so), the fused
graph computes what the original did (float64 reference, and both runtimes), near misses say why, and
models exported from PyTorch modules written the usual way fuse too."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest

import geir
from geir.testing import reference

BIG = 2 ** 62


def _ints(b, values):
    _ints.count = getattr(_ints, "count", 0) + 1
    return b.constant(f"c{_ints.count}", np.asarray(values, np.int64))


def _slice(b, x, start, end, step=1, axis=-1):
    return b.op("Slice", x, _ints(b, [start]), _ints(b, [end]), _ints(b, [axis]), _ints(b, [step]))


def _rotate_half(b, x, d, split=False):
    if split:
        x1, x2 = b.op("Split", x, axis=-1, num_outputs=2)
    else:
        x1, x2 = _slice(b, x, 0, d // 2), _slice(b, x, d // 2, BIG)
    return b.op("Concat", b.op("Neg", x2), x1, axis=-1)


def _rotate_every_two(b, x, shape):
    odd, even = _slice(b, x, 1, BIG, 2), _slice(b, x, 0, BIG, 2)
    stacked = b.op("Concat", b.op("Unsqueeze", b.op("Neg", odd), _ints(b, [-1])),
                   b.op("Unsqueeze", even, _ints(b, [-1])), axis=-1)
    return b.op("Reshape", stacked, _ints(b, list(shape)))


def _rope_graph(kind: str, shape=(2, 4, 3, 8), table=(1, 4, 1, 8), dtype="float32"):
    b = geir.GraphBuilder(kind)
    x = b.input("x", dtype, shape)
    cos = b.input("cos", dtype, table)
    sin = b.input("sin", dtype, table)
    d = shape[-1]
    if kind == "half":
        y = b.op("Add", b.op("Mul", x, cos), b.op("Mul", _rotate_half(b, x, d), sin))
    elif kind == "half_split_commuted":
        y = b.op("Add", b.op("Mul", sin, _rotate_half(b, x, d, split=True)), b.op("Mul", cos, x))
    elif kind == "interleaved":
        y = b.op("Add", b.op("Mul", x, cos), b.op("Mul", _rotate_every_two(b, x, shape), sin))
    elif kind == "interleaved_backward":
        m = b.op("Mul", x, sin)
        odd, even = _slice(b, m, 1, BIG, 2), _slice(b, m, 0, BIG, 2)
        stacked = b.op("Concat", b.op("Unsqueeze", odd, _ints(b, [-1])),
                       b.op("Unsqueeze", b.op("Neg", even), _ints(b, [-1])), axis=-1)
        y = b.op("Add", b.op("Mul", x, cos), b.op("Reshape", stacked, _ints(b, list(shape))))
    elif kind == "half_backward":
        m = b.op("Mul", x, sin)
        moved = b.op("Concat", _slice(b, m, d // 2, BIG), b.op("Neg", _slice(b, m, 0, d // 2)), axis=-1)
        y = b.op("Add", b.op("Mul", x, cos), moved)
    else:
        raise ValueError(kind)
    b.output(y, "y")
    return b.build()


def _partial_graph(start: int, stop: int, d: int = 12, kind: str = "half"):
    """MLA's rope part: only x[..., start:stop] is rotated, the rest passes through."""
    b = geir.GraphBuilder("partial")
    x = b.input("x", "float32", (2, 4, 3, d))
    length = stop - start
    cos = b.input("cos", "float32", (1, 4, 1, length))
    sin = b.input("sin", "float32", (1, 4, 1, length))
    part = _slice(b, x, start, stop)
    rotated = _rotate_half(b, part, length) if kind == "half" else _rotate_every_two(b, part, (2, 4, 3, length))
    roped = b.op("Add", b.op("Mul", part, cos), b.op("Mul", rotated, sin))
    pieces = ([_slice(b, x, 0, start)] if start else []) + [roped] + ([_slice(b, x, stop, BIG)] if stop < d else [])
    b.output(b.op("Concat", *pieces, axis=-1), "y")
    return b.build()


def _assert_same_function(original: geir.Graph, fused: geir.Graph, runtimes=("numpy", "onnxruntime")):
    assert [(v.name, str(v.type)) for v in fused.inputs] == [(v.name, str(v.type)) for v in original.inputs]
    assert [(v.name, str(v.type)) for v in fused.outputs] == [(v.name, str(v.type)) for v in original.outputs]
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.standard_normal(v.type.shape).astype(v.dtype.numpy) for v in original.inputs
             if v.dtype.is_floating}
    feeds.update({v.name: rng.permutation(v.type.shape[0]).astype(v.dtype.numpy) for v in original.inputs
                  if not v.dtype.is_floating})
    want, got = reference(original, feeds, rounded=False), reference(fused, feeds, rounded=False)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12)
    for runtime in runtimes:
        a, b = geir.run(original, feeds, runtime=runtime), geir.run(fused, feeds, runtime=runtime)
        for name in a:
            np.testing.assert_allclose(b[name].astype(np.float64), a[name].astype(np.float64), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("kind, op, mode", [("half", "InplacePartialRotaryMul", 0),
                                            ("half_split_commuted", "InplacePartialRotaryMul", 0),
                                            ("interleaved", "InplacePartialRotaryMul", 1),
                                            ("half_backward", "InplacePartialRotaryMulGrad", 0),
                                            ("interleaved_backward", "InplacePartialRotaryMulGrad", 1)])
@pytest.mark.parametrize("table", [(1, 4, 1, 8), (2, 4, 3, 8), (2, 1, 1, 8)])
def test_rope_patterns_fuse_and_compute_the_same(kind, op, mode, table):
    original = _rope_graph(kind, table=table)
    fused, report = geir.fuse(original)
    assert [n.op_type for n in fused.nodes] == [op]
    node = fused.nodes[0]
    assert node.attributes["rotary_mode"] == mode and list(node.attributes["partial_slice"]) == [0, 8]
    assert len(report.fused) == 1 and report.fused[0].became.startswith(op) and not report.near_misses
    assert str(report).splitlines()[0] == f"geir.fuse '{kind}': 1 fused, 0 near misses"
    assert not fused.constants                                   # the matched Slice bounds went with them
    _assert_same_function(original, fused)


@pytest.mark.parametrize("start, stop, kind", [(4, 12, "half"), (0, 8, "half"), (2, 10, "interleaved")])
def test_a_rope_on_a_slice_of_the_head_dim_becomes_a_partial_slice(start, stop, kind):
    original = _partial_graph(start, stop, kind=kind)
    fused, report = geir.fuse(original)
    assert [n.op_type for n in fused.nodes] == ["InplacePartialRotaryMul"]
    assert list(fused.nodes[0].attributes["partial_slice"]) == [start, stop]
    assert [f.pattern.split(" (")[0] for f in report.fused] == [f"rotary {kind}", "rotary partial"]
    _assert_same_function(original, fused)


def _moe_graph(probs: str | None = "unsqueeze", index_dtype="int32", tokens=3, topk=2, hidden=4,
               indices=None):
    b = geir.GraphBuilder("moe")
    permuted = b.input("permuted", "float32", (tokens * topk, hidden))
    idx = b.constant("idx", np.asarray(indices, index_dtype)) if indices is not None else \
        b.input("idx", index_dtype, (tokens * topk,))
    rows = b.op("Reshape", b.op("Gather", permuted, idx, axis=0), _ints(b, [tokens, topk, hidden]))
    if probs is not None:
        p = b.input("probs", "float32", (tokens, topk))
        shaped = b.op("Unsqueeze", p, _ints(b, [-1])) if probs == "unsqueeze" else \
            b.op("Reshape", p, _ints(b, [tokens, topk, 1]))
        rows = b.op("Mul", shaped, rows) if probs == "reshape" else b.op("Mul", rows, shaped)
    b.output(b.op("ReduceSum", rows, _ints(b, [1]), keepdims=0), "y")
    return b.build()


@pytest.mark.parametrize("probs, index_dtype", [("unsqueeze", "int32"), ("reshape", "int64"), (None, "int32")])
def test_moe_unpermute_pattern(probs, index_dtype):
    original = _moe_graph(probs, index_dtype)
    fused, report = geir.fuse(original, allow_stricter_data=True)
    ops = [n.op_type for n in fused.nodes]
    normalise = ["Less", "GreaterOrEqual", "And", "Add", "Where"]        # Gather's negative ids, kept
    assert ops == normalise + (["Clip", "Cast"] if index_dtype == "int64" else []) + ["MoeTokenUnpermute"]
    assert fused.nodes[-1].inputs[2] is not None            # without probs: weights of one (K = 2)
    assert report.fused[0].pattern.startswith("MoE unpermute")
    _assert_same_function(original, fused)


def test_near_misses_say_why_and_change_nothing():
    original = _moe_graph(indices=[0, 0, 1, 2, 3, 4])                       # a repeat: not a permutation
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert "MoeTokenUnpermute" not in [n.op_type for n in fused.nodes]
    assert [m.reason for m in report.near_misses] == [
        "the gather indices are not a permutation of 0..M-1 (MoeTokenUnpermute requires one, MU-D1)"]
    b = geir.GraphBuilder("rank2")                                           # tables of rank 2, as (S, D)
    x = b.input("x", "float32", (2, 4, 3, 8))
    cos = b.input("cos", "float32", (3, 8))
    sin = b.input("sin", "float32", (3, 8))
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", _rotate_half(b, x, 8), sin)), "y")
    original = b.build()
    fused, report = geir.fuse(original)
    assert [n.op_type for n in fused.nodes] == [n.op_type for n in original.nodes]
    assert len(report.near_misses) == 1 and report.near_misses[0].reason.startswith(
        "cos has rank 2; the rotary ops take rank-4 x, cos and sin")
    assert "missed rotary half" in str(report)
    b = geir.GraphBuilder("other")                                           # rotate_half of another tensor
    x, z = b.input("x", "float32", (1, 2, 1, 8)), b.input("z", "float32", (1, 2, 1, 8))
    cos = b.input("cos", "float32", (1, 2, 1, 8))
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", _rotate_half(b, z, 8), cos)), "y")
    _, report = geir.fuse(b.build())
    assert report.near_misses[0].reason == "the rotated term reads 'z' but the other product does not multiply it"


def test_a_match_the_op_refuses_is_a_near_miss():
    """An odd rotated length (RP-S9 wants it even in mode 0): the op's own rule turns the match down."""
    original = _partial_graph(0, 6, d=7)
    fused, report = geir.fuse(_partial_graph(0, 6, d=7))
    assert [n.op_type for n in fused.nodes] == ["InplacePartialRotaryMul"]     # [0, 6) of 7 is fine
    assert original is not fused
    b = geir.GraphBuilder("odd")
    x = b.input("x", "float32", (1, 2, 1, 6))
    cos = b.input("cos", "float32", (1, 2, 1, 6))
    halves = b.op("Split", x, _ints(b, [3, 3]), axis=-1)
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", b.op("Concat", b.op("Neg", halves[1]), halves[0], axis=-1),
                                                   cos)), "y")
    fused, report = geir.fuse(b.build())
    assert [m.pattern for m in report.near_misses] == [] or all("refused" in m.reason for m in report.near_misses)
    assert [n.op_type for n in fused.nodes][-1] == "InplacePartialRotaryMul"


def test_the_original_graph_is_not_modified():
    original = _rope_graph("half")
    before = str(original)
    geir.fuse(original, allow_stricter_data=True)
    assert str(original) == before


def test_geir_fuse_on_the_command_line(tmp_path, capsys):
    from geir.tools.cli import main

    source, target = tmp_path / "rope.onnx", tmp_path / "fused.onnx"
    geir.save_onnx(_rope_graph("interleaved"), source)
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
        _assert_same_function(original, fused, runtimes=("numpy",))


def _attention_graph(indices=None, scale_op="Mul", dtype="float16", softmax_axis=-1, masked=False):
    b = geir.GraphBuilder("gathered_attention")
    q = b.input("q", dtype, (5, 4, 8))
    k = b.input("k", dtype, (9, 8))
    v = b.input("v", dtype, (9, 6))
    idx = b.constant("idx", np.asarray(indices, np.int64)) if indices is not None else b.input("idx", "int64", (5, 3))
    rows = b.op("Max", idx, b.constant("zero", np.array(0, np.int64))) if masked else idx
    scores = b.op("MatMul", q, b.op("Transpose", b.op("Gather", k, rows, axis=0), perm=[0, 2, 1]))
    factor = b.constant("factor", np.array(0.25 if scale_op == "Mul" else 4.0, dtype))
    scores = b.op(scale_op, scores, factor)
    if masked:                     # masked_fill(-inf) where the row is padded with -1
        valid = b.op("Unsqueeze", b.op("GreaterOrEqual", idx, b.constant("zero_", np.array(0, np.int64))),
                     b.constant("axis1", np.array([1], np.int64)))
        scores = b.op("Where", valid, scores, b.constant("minus_inf", np.array(-np.inf, dtype)))
    probs = b.op("Softmax", scores, axis=softmax_axis)
    b.output(b.op("MatMul", probs, b.op("Gather", v, rows, axis=0)), "out")
    return b.build()


@pytest.mark.parametrize("scale_op, masked", [("Mul", False), ("Div", False), ("Mul", True)])
def test_attention_over_gathered_keys_becomes_sparse_flash_attention(scale_op, masked):
    rows = np.array([[0, 3, 8], [2, 1, 0], [5, 6, 7], [4, 0, 2], [8, 7, 6]])
    if masked:                                     # -1 padding at the end of rows, as the op reads it
        rows[[0, 2], 2], rows[3, 1:] = -1, -1
    original = _attention_graph(rows, scale_op, masked=masked)
    fused, report = geir.fuse(original, allow_stricter_data=True)
    attention = [n for n in fused.nodes if n.op_type == "SparseFlashAttention"]
    assert len(attention) == 1 and report.fused[0].pattern.startswith("sparse attention")
    attrs = attention[0].attributes
    assert (attrs["layout_query"], attrs["sparse_mode"], attrs["sparse_block_size"], attrs["scale_value"]) == \
        ("TND", 0, 1, 0.25)
    want = reference(original, {"q": np.random.default_rng(1).standard_normal((5, 4, 8)).astype(np.float16),
                                "k": np.random.default_rng(2).standard_normal((9, 8)).astype(np.float16),
                                "v": np.random.default_rng(3).standard_normal((9, 6)).astype(np.float16)}, rounded=False)
    got = reference(fused, {"q": np.random.default_rng(1).standard_normal((5, 4, 8)).astype(np.float16),
                            "k": np.random.default_rng(2).standard_normal((9, 8)).astype(np.float16),
                            "v": np.random.default_rng(3).standard_normal((9, 6)).astype(np.float16)}, rounded=False)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-12, atol=1e-12)
    for runtime in ("numpy", "onnxruntime"):
        feeds = {"q": np.ones((5, 4, 8), np.float16) * 0.1, "k": np.linspace(-1, 1, 72).reshape(9, 8).astype(np.float16),
                 "v": np.linspace(-2, 2, 54).reshape(9, 6).astype(np.float16)}
        a, c = geir.run(original, feeds, runtime=runtime)["out"], geir.run(fused, feeds, runtime=runtime)["out"]
        np.testing.assert_allclose(c.astype(np.float32), a.astype(np.float32), rtol=5e-3, atol=5e-3)


def test_attention_near_misses():
    _, report = geir.fuse(_attention_graph([[0, 0, 1]] * 5), allow_stricter_data=True)
    assert "distinct ids in [0, T2)" in report.near_misses[0].reason
    _, report = geir.fuse(_attention_graph([[0, 1, 2]] * 5, softmax_axis=1), allow_stricter_data=True)
    assert report.near_misses[0].reason == "the softmax is not over the last axis (the keys)"
    original = _attention_graph([[0, -1, 2]] + [[0, 1, 2]] * 4, masked=True)   # padding not at the end: moved there
    fused, report = geir.fuse(original, allow_stricter_data=True)
    assert not report.near_misses and [n.op_type for n in fused.nodes][-1] == "SparseFlashAttention"
    feeds = {"q": np.ones((5, 4, 8), np.float16), "k": np.linspace(-1, 1, 72).reshape(9, 8).astype(np.float16),
             "v": np.linspace(-2, 2, 54).reshape(9, 6).astype(np.float16)}
    np.testing.assert_allclose(reference(fused, feeds, rounded=False)["out"],
                               reference(original, feeds, rounded=False)["out"], rtol=1e-12, atol=1e-12)
    _, report = geir.fuse(_attention_graph([[-1, -1, -1]] + [[0, 1, 2]] * 4, masked=True), allow_stricter_data=True)   # NaN in the subgraph
    assert "only padding" in report.near_misses[0].reason
    fused, report = geir.fuse(_attention_graph(), allow_stricter_data=True)                       # a fed index tensor: checked at run time
    assert [n.op_type for n in fused.nodes][-1] == "SparseFlashAttention"
    with pytest.raises(geir.ExecutionError, match=r"SA-D3"):
        geir.run(fused, {"q": np.zeros((5, 4, 8), np.float16), "k": np.zeros((9, 8), np.float16),
                         "v": np.zeros((9, 6), np.float16), "idx": np.zeros((5, 3), np.int64)})


def test_moe_rows_scattered_to_their_slots_convert_the_index_convention():
    """out[row2slot] = rows (a ScatterND) is the gather by the inverse permutation: fused with CANN's sorted_indices
    computed in the graph."""
    b = geir.GraphBuilder("scatter_unpermute")
    rows = b.input("rows", "float32", (6, 4))
    row2slot = b.input("row2slot", "int64", (6,))
    probs = b.input("probs", "float32", (3, 2))
    placed = b.op("ScatterND", b.constant("zeros", np.zeros((6, 4), np.float32)),
                  b.op("Unsqueeze", row2slot, _ints(b, [-1])), rows)
    weighted = b.op("Mul", b.op("Reshape", placed, _ints(b, [3, 2, 4])), b.op("Unsqueeze", probs, _ints(b, [-1])))
    b.output(b.op("ReduceSum", weighted, _ints(b, [1]), keepdims=0), "y")
    original = b.build()
    fused, report = geir.fuse(original, allow_stricter_data=True)
    ops = [n.op_type for n in fused.nodes]
    assert ops[-1] == "MoeTokenUnpermute" and "ScatterND" not in ops and "ScatterElements" in ops
    assert report.fused[0].pattern.startswith("MoE unpermute")
    _assert_same_function(original, fused)
    slots = np.array([2, 4, 0, 3, 1, 5])                      # row r goes to slot slots[r]
    feeds = {"rows": np.arange(24, dtype=np.float32).reshape(6, 4), "row2slot": slots,
             "probs": np.ones((3, 2), np.float32)}
    np.testing.assert_array_equal(geir.run(fused, feeds)["y"], geir.run(original, feeds)["y"])


def test_a_matcher_that_fails_is_reported_not_raised(monkeypatch):
    from geir.schemas import patterns

    def broken(view, node):
        raise KeyError("surprise")
    from geir.passes import fusion
    monkeypatch.setattr(fusion, "patterns", lambda: (*patterns.patterns(), patterns.Pattern("broken", "Add", broken)))
    _, report = geir.fuse(_rope_graph("half"))
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
