"""geir.fuse on ropes: the patterns and variants exporters emit (rotate_half, rotate_every_two, their backward forms,
a rope on a slice of the head dim) become the rotary ops and compute what the original did; a match the op refuses
is a near miss."""

from __future__ import annotations

import pytest

import geir
from helpers import BIG, assert_same_function, ints, onnx_slice
from rotary.helpers import rope_subgraph, rotate_every_two, rotate_half


def _partial_graph(start: int, stop: int, d: int = 12, kind: str = "half"):
    """MLA's rope part: only x[..., start:stop] is rotated, the rest passes through."""
    b = geir.GraphBuilder("partial")
    x = b.input("x", "float32", (2, 4, 3, d))
    length = stop - start
    cos = b.input("cos", "float32", (1, 4, 1, length))
    sin = b.input("sin", "float32", (1, 4, 1, length))
    part = onnx_slice(b, x, start, stop)
    rotated = rotate_half(b, part, length) if kind == "half" else rotate_every_two(b, part, (2, 4, 3, length))
    roped = b.op("Add", b.op("Mul", part, cos), b.op("Mul", rotated, sin))
    pieces = (([onnx_slice(b, x, 0, start)] if start else []) + [roped]
              + ([onnx_slice(b, x, stop, BIG)] if stop < d else []))
    b.output(b.op("Concat", *pieces, axis=-1), "y")
    return b.build()


@pytest.mark.parametrize("kind, op, mode", [("half", "InplacePartialRotaryMul", 0),
                                            ("half_split_commuted", "InplacePartialRotaryMul", 0),
                                            ("interleaved", "InplacePartialRotaryMul", 1),
                                            ("half_backward", "InplacePartialRotaryMulGrad", 0),
                                            ("interleaved_backward", "InplacePartialRotaryMulGrad", 1)])
@pytest.mark.parametrize("table", [(1, 4, 1, 8), (2, 4, 3, 8), (2, 1, 1, 8)])
def test_rope_patterns_fuse_and_compute_the_same(kind, op, mode, table):
    original = rope_subgraph(kind, table=table)
    fused, report = geir.fuse(original)
    assert [n.op_type for n in fused.nodes] == [op]
    node = fused.nodes[0]
    assert node.attributes["rotary_mode"] == mode and list(node.attributes["partial_slice"]) == [0, 8]
    assert len(report.fused) == 1 and report.fused[0].became.startswith(op) and not report.near_misses
    assert str(report).splitlines()[0] == f"geir.fuse '{kind}': 1 fused, 0 near misses"
    assert not fused.constants                                   # the matched Slice bounds went with them
    assert_same_function(original, fused)


@pytest.mark.parametrize("start, stop, kind", [(4, 12, "half"), (0, 8, "half"), (2, 10, "interleaved")])
def test_a_rope_on_a_slice_of_the_head_dim_becomes_a_partial_slice(start, stop, kind):
    original = _partial_graph(start, stop, kind=kind)
    fused, report = geir.fuse(original)
    assert [n.op_type for n in fused.nodes] == ["InplacePartialRotaryMul"]
    assert list(fused.nodes[0].attributes["partial_slice"]) == [start, stop]
    assert [f.pattern.split(" (")[0] for f in report.fused] == [f"rotary {kind}", "rotary partial"]
    assert_same_function(original, fused)


def test_a_match_the_op_refuses_is_a_near_miss():
    """An odd rotated length (RP-S9 wants it even in mode 0): the op's own rule turns the match down."""
    original = _partial_graph(0, 6, d=7)
    fused, report = geir.fuse(_partial_graph(0, 6, d=7))
    assert [n.op_type for n in fused.nodes] == ["InplacePartialRotaryMul"]     # [0, 6) of 7 is fine
    assert original is not fused
    b = geir.GraphBuilder("odd")
    x = b.input("x", "float32", (1, 2, 1, 6))
    cos = b.input("cos", "float32", (1, 2, 1, 6))
    halves = b.op("Split", x, ints(b, [3, 3]), axis=-1)
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", b.op("Concat", b.op("Neg", halves[1]), halves[0], axis=-1),
                                                   cos)), "y")
    fused, report = geir.fuse(b.build())
    assert [m.pattern for m in report.near_misses] == [] or all("refused" in m.reason for m in report.near_misses)
    assert [n.op_type for n in fused.nodes][-1] == "InplacePartialRotaryMul"


def _computed_bounds_rope(batch, seq):
    """TorchScript's rotate_half: ``x[..., : x.shape[-1] // 2]``, bounds computed by Shape, Gather and Div."""
    b = geir.GraphBuilder("computed_bounds")
    x = b.input("x", "float32", (batch, seq, 3, 8))
    cos = b.input("cos", "float32", (1, seq, 1, 8))
    sin = b.input("sin", "float32", (1, seq, 1, 8))
    width = b.op("Gather", b.op("Shape", x), ints(b, [3], "last"))
    half = b.op("Div", width, ints(b, [2], "two"))
    first = b.op("Slice", x, ints(b, [0], "zero"), half, ints(b, [3], "axis"))
    second = b.op("Slice", x, half, ints(b, [BIG], "end"), ints(b, [3], "axis2"))
    rotated = b.op("Concat", b.op("Neg", second), first, axis=-1)
    b.output(b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin)), "y")
    return b.build()


def test_halves_sliced_at_bounds_computed_from_the_shape_fuse():
    """The bounds fold where the dims they read are static; the rope fuses."""
    original = _computed_bounds_rope(2, 4)
    fused, report = geir.fuse(original)
    assert [n.op_type for n in fused.nodes] == ["InplacePartialRotaryMul"], report
    assert list(fused.nodes[0].attributes["partial_slice"]) == [0, 8]
    assert_same_function(original, fused)


def test_computed_bounds_on_symbolic_batch_and_sequence_are_a_near_miss_not_a_silent_one():
    """With symbolic batch and sequence the halves still fold (they read the static head dim), so the rope is found;
    the sliced values' types lost the symbols, so the fused op's output type would differ: a near miss saying so."""
    original = _computed_bounds_rope("b", "s")
    fused, report = geir.fuse(original)
    assert [n.op_type for n in fused.nodes] == [n.op_type for n in original.nodes]
    assert len(report.near_misses) == 1 and "would give float32[b,s,3,8]" in report.near_misses[0].reason


def _half_width_rope(pairing: str, table_width: int = 4):
    """GPT-OSS (halves by Split) and DeepSeek-V3's rope_interleave (even and odd elements by strided Slice):
    ``cat(a * c - b * s, b * c + a * s)`` with tables of half the head dim, products in the exporters' orders."""
    b = geir.GraphBuilder(f"half_width_{pairing}")
    x = b.input("x", "float32", (2, 4, 3, 8))
    cos = b.input("cos", "float32", (1, 4, 1, table_width))
    sin = b.input("sin", "float32", (1, 4, 1, table_width))
    if pairing == "split":
        first, second = b.op("Split", x, ints(b, [4, 4], "sizes"), axis=-1)
    else:
        first = onnx_slice(b, x, 0, BIG, step=2)
        second = onnx_slice(b, x, 1, BIG, step=2)
    low = b.op("Sub", b.op("Mul", first, cos), b.op("Mul", second, sin))
    high = b.op("Add", b.op("Mul", sin, first), b.op("Mul", second, cos))
    b.output(b.op("Concat", low, high, axis=-1), "y")
    return b.build()


@pytest.mark.parametrize("pairing, mode", [("split", 0), ("even_odd", 3)])
def test_half_width_tables_fuse_with_the_tables_duplicated(pairing, mode):
    original = _half_width_rope(pairing)
    fused, report = geir.fuse(original)
    ops = [n.op_type for n in fused.nodes]
    assert ops.count("InplacePartialRotaryMul") == 1 and set(ops) == {"InplacePartialRotaryMul", "Concat"}, report
    node = next(n for n in fused.nodes if n.op_type == "InplacePartialRotaryMul")
    assert node.attributes["rotary_mode"] == mode and list(node.attributes["partial_slice"]) == [0, 8]
    assert [f.pattern.split(" (")[0] for f in report.fused] == ["rotary half-width tables"]
    assert_same_function(original, fused)


def test_half_width_tables_of_another_width_are_a_near_miss():
    original = _half_width_rope("split", table_width=1)
    fused, report = geir.fuse(original)
    assert "InplacePartialRotaryMul" not in [n.op_type for n in fused.nodes]
    assert [m.reason for m in report.near_misses] == [
        "the tables' last dims are 1 and 1, not half of x's 8: they cannot be duplicated to the rotated width"]


def test_split_pieces_and_a_merged_half_width_rope_fuse_to_a_partial_slice():
    """MLA as the exporters write it: q split into (nope, pe) by one Split; dynamo ropes pe and concatenates the
    pieces (the partial pattern, pieces from the Split), TorchScript writes the rope's two terms straight into the
    Concat with the nope piece (``cat(q_nope, a * c - b * s, b * c + a * s)``)."""
    for merged in (False, True):
        b = geir.GraphBuilder("mla")
        q = b.input("q", "float32", (2, 4, 3, 12))
        cos = b.input("cos", "float32", (1, 4, 1, 4))
        sin = b.input("sin", "float32", (1, 4, 1, 4))
        nope, pe = b.op("Split", q, ints(b, [4, 8], "sizes"), axis=-1)
        even, odd = onnx_slice(b, pe, 0, BIG, step=2), onnx_slice(b, pe, 1, BIG, step=2)
        low = b.op("Sub", b.op("Mul", even, cos), b.op("Mul", odd, sin))
        high = b.op("Add", b.op("Mul", odd, cos), b.op("Mul", even, sin))
        pieces = [nope, low, high] if merged else [nope, b.op("Concat", low, high, axis=-1)]
        b.output(b.op("Concat", *pieces, axis=-1), "y")
        original = b.build()
        fused, report = geir.fuse(original)
        rope = [n for n in fused.nodes if n.op_type == "InplacePartialRotaryMul"]
        assert len(rope) == 1 and not report.near_misses, report
        assert rope[0].attributes["rotary_mode"] == 3 and list(rope[0].attributes["partial_slice"]) == [4, 12]
        assert rope[0].inputs[0].name == "q"
        assert_same_function(original, fused)


def test_rotate_half_of_pieces_of_unknown_size_is_a_near_miss_not_a_silent_one():
    """GPT-NeoX's TorchScript export: the rotated part is a slice whose bound is computed from data the fusion cannot
    fold, so its last dim is a symbol; the rope is reported with the reason."""
    b = geir.GraphBuilder("unknown_halves")
    x = b.input("x", "float32", (2, 4, 3, 8))
    width = b.input("width", "int64", (1,))
    cos = b.input("cos", "float32", (1, 4, 1, 4))
    sin = b.input("sin", "float32", (1, 4, 1, 4))
    part = b.op("Slice", x, ints(b, [0], "zero"), width, ints(b, [3], "axis"))
    rotated = b.op("Concat", b.op("Neg", onnx_slice(b, part, 2, BIG)), onnx_slice(b, part, 0, 2), axis=-1)
    b.output(b.op("Add", b.op("Mul", part, cos), b.op("Mul", rotated, sin)), "y")
    _, report = geir.fuse(b.build())
    assert len(report.near_misses) == 1
    assert report.near_misses[0].reason.startswith("rotate_half's pieces are not x[..., :d/2] and x[..., d/2:]")
