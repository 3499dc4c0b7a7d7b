"""geir.fuse on dense attention masked by a top-k key selection (DeepSeek-V3.2's eager attention, as exporters write
it): it becomes SparseFlashAttention (BSND, causal mode 3 or mode 0), computes what the original did even where TopK
puts a visible key after hidden ones, and its near misses say why."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import geir
from geir.testing import reference

B, N, S, T, D = 1, 2, 4, 4, 4


def _top_k_attention(*, k=4, mask="causal", dtype="float16", key_heads=N, s=S, t=T, form="additive"):
    """softmax(q @ k^T * 0.5 + Where(Unsqueeze(not selected, 1), -inf, additive mask)) @ v, the selection scattered
    from TopK(r, k) ids."""
    b = geir.GraphBuilder("top_k_attention")
    q = b.input("q", dtype, (B, N, s, D))
    key, value = b.input("k", dtype, (B, key_heads, t, D)), b.input("v", dtype, (B, key_heads, t, D))
    index_scores = b.input("r", dtype, (B, s, t))
    ids = b.op("TopK", index_scores, b.constant("count", np.array([k], np.int64)), axis=-1)[1]
    updates = b.op("ConstantOfShape", b.constant("ids_shape", np.array([B, s, k], np.int64)),
                   value=helper.make_tensor("value", TensorProto.BOOL, [1], [False]))
    unselected = b.op("ScatterElements", b.constant("all", np.ones((B, s, t), bool)), ids, updates, axis=-1)
    condition = b.op("Unsqueeze", unselected, b.constant("axis1", np.array([1], np.int64)))
    rows, cols = np.arange(s)[:, None], np.arange(t)[None, :]
    visible = {"causal": cols <= rows + t - s, "computed": cols <= rows + t - s, "none": np.ones((s, t), bool),
               "window": abs(cols - rows) <= 1}[mask]
    if mask == "computed":                 # as exporters leave it at larger sizes: Where(And(...)) of constants
        keep = b.op("And", b.op("LessOrEqual", b.constant("cols", cols[None, None]), b.constant("rows", rows + t - s)),
                    b.constant("padding", np.ones((B, 1, 1, t), bool)))
        additive = b.op("Where", keep, b.constant("zero", np.array(0, dtype)), b.constant("hide", np.array(-np.inf, dtype)))
    else:
        additive = b.constant("mask", np.where(visible, 0, -np.inf).astype(dtype)[None, None])
    scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", key, perm=[0, 1, 3, 2])),
                  b.constant("scale", np.array(0.5, dtype)))
    minus_inf = b.constant("minus_inf", np.array(-np.inf, dtype))
    logits = b.op("Add", scores, b.op("Where", condition, minus_inf, additive)) if form == "additive" else \
        b.op("Where", condition, minus_inf, scores)
    b.output(b.op("MatMul", b.op("Softmax", logits, axis=-1), value), "out")
    return b.build()


def _feeds(r, *, key_heads=N, s=S, t=T, dtype=np.float16):
    rng = np.random.default_rng(7)
    return {"q": rng.standard_normal((B, N, s, D)).astype(dtype),
            "k": rng.standard_normal((B, key_heads, t, D)).astype(dtype),
            "v": rng.standard_normal((B, key_heads, t, D)).astype(dtype), "r": np.asarray(r, dtype)}


LATE = [[[0, 1, 2, 3]] * S]
"""Index scores that make TopK list the hidden (future) keys first: row 0 sees key 0 only, which comes last. The op
reads a row's first min(K, visible) entries, so the ids must be reordered for the fused graph to keep key 0."""


@pytest.mark.parametrize("mask", ["causal", "computed"])
@pytest.mark.parametrize("key_heads", [N, 1])
@pytest.mark.parametrize("r", [LATE, [[[3, 2, 1, 0]] * S], [[[0, 5, 1, 4]] * S]])
def test_top_k_masked_attention_becomes_causal_sparse_flash_attention(r, key_heads, mask):
    original = _top_k_attention(key_heads=key_heads, mask=mask)
    fused, report = geir.fuse(original, allow_stricter_data=True)
    attention = [n for n in fused.nodes if n.op_type == "SparseFlashAttention"]
    assert len(attention) == 1 and report.fused[0].pattern.startswith("sparse attention top-k mask"), report
    attrs = attention[0].attributes
    assert (attrs["layout_query"], attrs["layout_kv"], attrs["sparse_mode"], attrs["sparse_block_size"],
            attrs["scale_value"]) == ("BSND", "BSND", 3, 1, 0.5)
    assert attention[0].inputs[3].type.shape == (B, S, key_heads, 4)          # one id row per KV head
    feeds = _feeds(r, key_heads=key_heads)
    np.testing.assert_allclose(reference(fused, feeds, rounded=False)["out"],
                               reference(original, feeds, rounded=False)["out"], rtol=1e-12, atol=1e-12)
    for runtime in ("numpy", "onnxruntime"):
        want, got = (geir.run(g, feeds, runtime=runtime)["out"].astype(np.float32) for g in (original, fused))
        np.testing.assert_allclose(got, want, rtol=5e-3, atol=5e-3)


def test_selection_without_an_additive_mask_is_mode_0_and_fewer_keys_than_rows_are_read():
    original = _top_k_attention(k=2, form="fill scores")
    fused, _ = geir.fuse(original, allow_stricter_data=True)
    assert [n.attributes["sparse_mode"] for n in fused.nodes if n.op_type == "SparseFlashAttention"] == [0]
    feeds = _feeds([[[0, 3, 1, 2]] * S])
    np.testing.assert_allclose(reference(fused, feeds, rounded=False)["out"],
                               reference(original, feeds, rounded=False)["out"], rtol=1e-12, atol=1e-12)


def _only_miss(graph, *, strict=True):
    _, report = geir.fuse(graph, allow_stricter_data=strict)
    assert not report.fused, report
    return [m.reason for m in report.near_misses if m.pattern.startswith("sparse attention top-k")]


def test_near_misses_say_why():
    assert "neither causal (bottom-right) nor empty" in _only_miss(_top_k_attention(mask="window"))[0]
    assert "more query rows (4) than keys (3)" in _only_miss(_top_k_attention(k=3, t=3))[0]
    assert "expected dtype in {float16, bfloat16}, got float32" in _only_miss(_top_k_attention(dtype="float32"))[0]
    reason = _only_miss(_top_k_attention(), strict=False)[0]       # a hidden key's score plus -inf: NaN if +inf
    assert "skips a key the mask hides" in reason and "allow_stricter_data=True" in reason


def test_dense_attention_is_reported_not_skipped():
    b = geir.GraphBuilder("dense")
    q, k, v = (b.input(n, "float16", (B, N, S, D)) for n in "qkv")
    scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2])),
                  b.constant("scale", np.array(0.5, np.float16)))
    causal = np.where(np.tri(S, dtype=bool), 0, -np.inf).astype(np.float16)[None, None]
    logits = b.op("Add", scores, b.constant("causal", causal))
    b.output(b.op("MatMul", b.op("Softmax", logits, axis=-1), v), "out")
    assert _only_miss(b.build())[0].startswith("attention over every key (no top-k selection masks the scores)")


def _dynamic_top_k_attention(*, keys_from_queries=True, keys_last=True):
    """The dynamic export's form: symbolic batch and sequence, the causal mask computed from the input's shape as
    transformers writes it (key position <= query position of one Range, and'ed with an all-ones padding mask),
    the selection's all-True mask Cast(Expand(1, shape)) and its False updates ConstantOfShape(Shape(ids))."""
    b = geir.GraphBuilder("dynamic_top_k")
    q, key, value = (b.input(n, "float16", ("b", N, "s", D)) for n in "qkv")
    index_scores = b.input("r", "float16", ("b", "s", "s"))

    def ints(name, values):
        return b.constant(name, np.asarray(values, np.int64))
    ids = b.op("TopK", index_scores, ints("count", [2]), axis=-1)[1]
    shape = b.op("Shape", index_scores)
    everywhere = b.op("Cast", b.op("Expand", ints("one", 1), shape), to=TensorProto.BOOL)
    updates = b.op("ConstantOfShape", b.op("Shape", ids), value=helper.make_tensor("value", TensorProto.BOOL, [1],
                                                                                     [False]))
    condition = b.op("Unsqueeze", b.op("ScatterElements", everywhere, ids, updates, axis=-1), ints("axis1", [1]))
    length = b.op("Squeeze", b.op("Gather", b.op("Shape", q), ints("i2", [2]), axis=0), ints("i0", [0]))
    positions = b.op("Range", ints("zero", 0), length, ints("step", 1))
    other = positions if keys_from_queries else b.op("Range", ints("zero2", 0), b.op(
        "Squeeze", b.op("Gather", b.op("Shape", key), ints("j2", [2]), axis=0), ints("j0", [0])), ints("step2", 1))
    as_keys = b.op("Unsqueeze", other, ints("keys_axes", [0, 1, 2] if keys_last else [0, 1, 3]))
    as_queries = b.op("Unsqueeze", positions, ints("query_axes", [0, 1, 3] if keys_last else [0, 1, 2]))
    padding = b.op("Cast", b.op("Expand", ints("ones", 1), b.op("Shape", index_scores)), to=TensorProto.BOOL)
    visible = b.op("And", b.op("LessOrEqual", as_keys, as_queries), b.op("Unsqueeze", padding, ints("p1", [1])))
    causal = b.op("Where", visible, b.constant("zero_f", np.array(0, np.float16)),
                  b.constant("lowest", np.array(np.finfo(np.float16).min, np.float16)))
    fill = b.constant("fill", np.array(np.finfo(np.float16).min, np.float16))
    scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", key, perm=[0, 1, 3, 2])),
                  b.constant("scale", np.array(0.5, np.float16)))
    logits = b.op("Add", scores, b.op("Where", condition, fill, causal))
    b.output(b.op("MatMul", b.op("Softmax", logits, axis=-1), value), "out")
    model = geir.to_onnx(b.build())                     # imported, as an export is: its computed sizes get symbols
    del model.graph.value_info[:]                       # (the builder's own names for them would stand otherwise)
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("out", TensorProto.FLOAT16, ["b", N, "s", D]))
    return geir.from_onnx(model, symbolic_shapes=True)


def test_a_dynamic_export_with_its_mask_computed_from_the_shape_fuses():
    original = _dynamic_top_k_attention()
    fused, report = geir.fuse(original, allow_stricter_data=True)
    attention = [n for n in fused.nodes if n.op_type == "SparseFlashAttention"]
    assert len(attention) == 1 and attention[0].attributes["sparse_mode"] == 3, report
    rng = np.random.default_rng(3)
    for batch, seq in [(2, 5), (1, 1), (1, 3), (3, 6)]:
        feeds = {n: rng.standard_normal((batch, N, seq, D)).astype(np.float16) for n in "qkv"}
        causal = np.tri(seq, dtype=bool)               # the indexer scores hidden keys lowest, as DeepSeek-V3.2's does
        feeds["r"] = np.where(causal, rng.standard_normal((batch, seq, seq)), -6e4).astype(np.float16)
        if seq == 1:                     # TopK of 2 over one key fails in both graphs
            for graph in (original, fused):
                with pytest.raises(geir.ExecutionError):
                    geir.run(graph, feeds, runtime="numpy")
            continue
        np.testing.assert_allclose(reference(fused, feeds, rounded=False)["out"],
                                   reference(original, feeds, rounded=False)["out"], rtol=1e-12, atol=1e-12)
        for runtime in ("numpy", "onnxruntime"):
            want, got = (geir.run(g, feeds, runtime=runtime)["out"].astype(np.float32) for g in (original, fused))
            np.testing.assert_allclose(got, want, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("variant, reason", [
    (dict(keys_from_queries=False), "cannot read before the graph runs"),     # two Ranges: lengths not provably one
    (dict(keys_last=False), "cannot read before the graph runs"),             # key >= query: not causal
])
def test_a_computed_mask_geir_cannot_read_is_a_near_miss(variant, reason):
    assert reason in _only_miss(_dynamic_top_k_attention(**variant))[0]
