"""ONNX bodies of the sparse flash-attention ops (spec 4.5-4.7).

Query rows are flattened (BSND ``b*S1 + s1``, TND ``t``); every row gathers a padded set of
``K * sparse_block_size`` candidate keys with clamped indices and a validity mask (entry
index below ``n_valid``, no -1 before it, position below the threshold), so all products
are batched MatMuls; masked scores are -inf and masked probabilities 0; the grad sums key
and value contributions by a scatter with distinct targets into a dense per-segment weight matrix
and one MatMul (never a scatter-add, whose ONNX Runtime CPU kernel races on duplicate targets), over the finite
values only: the terms holding an infinity or NaN are added per key read (the dense product would meet them with the
0 weight of every key a row does not read). Intermediate
roundings are ``CastLike(input dtype)`` + ``Cast(float)``. Bodies are specialised on the
layout, the sparse mode, ``return_softmax_lse`` and which optional inputs exist. A paged cache runs the same
body, its candidates read through the block table (``paging``).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ...ir._onnx_body import Body
from ...ir._lowering import LoweringSpec, register_lowering
from .schema import FORWARD, GRAD, PAGED


class _Rows:
    """Row metadata and candidate keys of every flattened query row, as body values."""

    def __init__(self, b: Body, spec: LoweringSpec, layout: str, honor_bsnd_lengths: bool, kv: dict[str, str]) -> None:
        self.b = b
        self.layout = layout
        self.kv = kv
        one = b.ints(1)
        if layout == "BSND":
            s1_size, s2_size = b.dim("query", 1), kv.get("seq_kv") or b.dim(kv["key"], 1)
            rows_total = b.op("Mul", b.dim("query", 0), s1_size)
            self.kv_total = b.op("Mul", b.dim("query", 0), s2_size)
            rows = b.op("Range", b.const(0), b.scalar(rows_total), b.const(1))
            batch = b.op("Div", rows, s1_size)
            self.s1 = b.op("Mod", rows, s1_size)

            def length(name: str, full: str) -> str:
                if honor_bsnd_lengths and spec.has(name):
                    return b.op("Gather", b.to_int64(kv.get(name, name)), batch)
                return b.op("Expand", full, b.op("Shape", rows))
            self.s1_len, self.s2_len = length("actual_seq_lengths_query", s1_size), length("actual_seq_lengths_kv", s2_size)
            self.kv_start = b.op("Mul", batch, s2_size)
            self.active = b.op("Less", self.s1, self.s1_len)
            self.batch, self.max_keys = batch, s2_size
        else:
            rows_total, self.kv_total = b.dim("query", 0), kv.get("seq_kv") or b.dim(kv["key"], 0)
            rows = b.op("Range", b.const(0), b.scalar(rows_total), b.const(1))
            aq, akv = b.to_int64("actual_seq_lengths_query"), b.to_int64(kv["actual_seq_lengths_kv"])
            batches = b.dim(aq, 0)
            ended = b.op("LessOrEqual", b.unsqueeze(aq, 0), b.unsqueeze(rows, 1))        # (rows, B)
            batch = b.sum(b.to_int64(ended), 1)
            self.active = b.op("Less", batch, batches)
            last = b.op("Min", batch, b.op("Sub", batches, one))
            previous = b.op("Max", b.op("Sub", last, one), b.ints(0))
            first = b.op("Greater", last, b.ints(0))
            q_start = b.where(first, b.op("Gather", aq, previous), b.ints(0))
            self.kv_start = b.where(first, b.op("Gather", akv, previous), b.ints(0))
            self.s1 = b.op("Sub", rows, q_start)
            self.s1_len = b.op("Sub", b.op("Gather", aq, last), q_start)
            self.s2_len = b.op("Sub", b.op("Gather", akv, last), self.kv_start)
            self.batch, self.max_keys = last, self.kv_total
        self.rows_total = rows_total
        mode = spec.attr("sparse_mode")
        self.threshold = self.s2_len if mode == 0 else b.op(
            "Add", b.op("Sub", self.s2_len, self.s1_len), b.op("Add", self.s1, one))

    def candidates(self) -> tuple[str, str, str, str]:
        """(flat key rows (rows, N2, Lp) into a (T2*N2, .) table, validity, Lp, clamped key rows (rows, N2, Lp))."""
        b = self.b
        heads = b.dim(self.kv["key"], -2)
        entries = b.reshape(b.to_int64("sparse_indices"), self.rows_total, heads, b.dim("sparse_indices", -1))
        block = b.attr_int("sparse_block_size")
        block1 = b.unsqueeze(block, 0)
        # only entries below ceil(max_keys / bs) and offsets below max_keys can be visible (candidate_grid); at least
        # one candidate, as there: a paged cache whose lengths are all 0 has no key, and an empty key axis would make
        # ReduceMax fail on older ONNX Runtimes (1.17)
        max_keys = b.op("Max", self.max_keys, b.ints(1))
        topk = b.op("Min", b.dim(entries, 2), b.op("Add", b.op("Div", b.op("Sub", max_keys, b.ints(1)), block1),
                                                   b.ints(1)))
        entries = b.slice(entries, b.ints(0), topk, 2)
        thr = b.unsqueeze(self.threshold, 1, 2)                                        # (rows, 1, 1)
        last_block = b.op("Div", b.op("Sub", thr, b.const(1)), block)                  # read when thr > 0
        n_valid = b.where(b.op("Greater", thr, b.ints(0)), b.op("Min", b.op("Add", last_block, b.const(1)), topk),
                          b.ints(0))
        entry = b.op("Range", b.const(0), b.scalar(topk), b.const(1))
        no_pad_yet = b.op("Equal", b.op("CumSum", b.to_int64(b.op("Equal", entries, b.const(-1))), b.const(2)),
                          b.ints(0))
        in_reach = b.op("And", b.op("GreaterOrEqual", entries, b.ints(0)), b.op("LessOrEqual", entries, last_block))
        entry_ok = b.op("And", b.op("And", b.op("Less", entry, n_valid), no_pad_yet), in_reach)   # (rows, N2, K')
        entries = b.where(entry_ok, entries, b.ints(0))                                # no overflow in the multiply
        offsets_count = b.op("Min", block1, max_keys)
        offsets = b.op("Range", b.const(0), b.scalar(offsets_count), b.const(1))
        positions = b.op("Add", b.op("Mul", b.unsqueeze(entries, 3), block), offsets)  # (rows, N2, K', O)
        ok = b.op("Expand", b.unsqueeze(entry_ok, 3), b.op("Shape", positions))
        in_range = b.op("And", b.op("Less", positions, b.unsqueeze(thr, 3)),
                        b.op("GreaterOrEqual", positions, b.ints(0)))
        valid = b.op("And", b.op("And", ok, in_range), b.unsqueeze(self.active, 1, 2, 3))
        span = b.op("Mul", topk, offsets_count)
        positions = b.reshape(positions, self.rows_total, heads, span)
        valid = b.reshape(valid, self.rows_total, heads, span)
        key_rows = b.op("Add", b.unsqueeze(self.kv_start, 1, 2), positions)
        key_rows = b.op("Max", b.op("Min", key_rows, b.op("Sub", self.kv_total, b.ints(1))), b.ints(0))
        home = self._cache_rows(positions) if "seq_kv" in self.kv else key_rows
        flat = b.op("Add", b.op("Mul", home, heads),
                    b.unsqueeze(b.op("Range", b.const(0), b.scalar(heads), b.const(1)), 0, 2))
        self.key_rows = key_rows
        return flat, valid, span, key_rows

    def _cache_rows(self, positions: str) -> str:
        """Paged cache (``paging.PagedKeys`` written with Gather): the cache row of each candidate, key j of the row's
        batch b at ``block_table[b, j // page] * page + j % page``; positions a row does not read are clamped into
        the table (they stand for keys no selection reads). Work follows the candidates, not max_blocks * page."""
        b = self.b
        page, columns = b.dim("key", 1), b.dim("block_table", 1)
        table = b.op("Max", b.op("Min", b.to_int64("block_table"), b.op("Sub", b.dim("key", 0), b.ints(1))),
                     b.ints(0))
        j = b.op("Max", b.op("Min", positions, b.op("Sub", b.op("Mul", columns, page), b.ints(1))), b.ints(0))
        column = b.op("Add", b.op("Mul", b.unsqueeze(self.batch, 1, 2), columns), b.op("Div", j, page))
        pages = b.op("Gather", b.reshape(table, -1), column, axis=0)                      # (rows, N2, Lp)
        return b.op("Add", b.op("Mul", pages, page), b.op("Mod", j, page))

    def segments(self) -> tuple[str, str, str]:
        """(segments, query rows per segment, keys per segment): BSND one segment per batch (a row only
        reads its own batch's keys), TND the whole tensor."""
        b = self.b
        if self.layout == "BSND":
            return b.dim("query", 0), b.dim("query", 1), b.dim(self.kv["key"], 1)
        return b.ints(1), b.dim("query", 0), b.dim(self.kv["key"], 0)

    def key_columns(self, valid: str) -> str:
        """Each candidate's key column within its segment, (rows, N2, Lp); invalid ones -> the spare column."""
        b = self.b
        _, _, keys = self.segments()
        start = self.kv_start if self.layout == "BSND" else b.ints(0)
        relative = b.op("Sub", self.key_rows, b.unsqueeze(start, 1, 2) if self.layout == "BSND" else start)
        return b.where(valid, relative, keys)


_DENSE_KV = {"key": "key", "value": "value", "key_rope": "key_rope", "actual_seq_lengths_kv": "actual_seq_lengths_kv"}


def _paged_kv(b: Body, spec: LoweringSpec, layout: str) -> dict[str, str]:
    """The dense problem a paged cache stands for: its kv lengths (per batch for BSND, cumulative for TND) and its
    keys per batch (``seq_kv``: BSND max_blocks * page, TND the lengths' sum). key/value/key_rope stay the caches:
    ``_Rows`` reads each candidate through the block table (``_cache_rows``)."""
    if layout == "BSND":
        lengths, seq_kv = "actual_seq_lengths_kv", b.op("Mul", b.dim("block_table", 1), b.dim("key", 1))
    else:
        akv = b.to_int64("actual_seq_lengths_kv")
        lengths, seq_kv = b.op("CumSum", akv, b.const(0)), b.sum(akv, 0, keepdims=1)
    return dict(_DENSE_KV, actual_seq_lengths_kv=lengths, seq_kv=seq_kv)


def _table(b: Body, spec: LoweringSpec, names: tuple[str, ...], kv: dict[str, str] = _DENSE_KV) -> str:
    """Rows of the present tensors of ``names``, float32, concatenated on the last axis, as (rows*N, D)."""
    parts = [b.to_float(kv.get(n, n)) for n in names if n in ("query", "key", "value") or spec.has(n)]
    joined = parts[0] if len(parts) == 1 else b.concat(*parts, axis=-1)
    return b.reshape(joined, -1, b.dim(joined, -1))


def _any_key(b: Body, flags: str) -> str:
    """Whether any of the boolean ``flags`` (rows, N2, ., Lp) is set along the key axis, kept as an axis of 1."""
    return b.op("Greater", b.op("ReduceMax", b.to_float(flags), b.ints(3), keepdims=1), b.f32(0.5))


def _only_valid(b: Body, gathered: str, valid: str) -> str:
    """Gathered rows (rows, N2, Lp, .) with 0 at the candidate positions a row does not read: those hold clamped
    stand-in rows, whose NaN or inf would otherwise reach a product through a 0 weight (0 * inf is NaN)."""
    return b.where(b.unsqueeze(valid, 3), gathered, b.f32(0.0))


def _finite_only(b: Body, x: str) -> str:
    """``x`` with 0 in place of every infinity or NaN (``x - x == 0`` holds exactly for the finite values)."""
    return b.where(b.op("Equal", b.op("Sub", x, x), b.f32(0.0)), x, b.f32(0.0))


def _non_finite_terms(b: Body, weights: str, right: str, valid: str, flat: str, finite_sum: str) -> str:
    """``finite_sum`` (T2*N2, W) plus the terms ``weights[r, n2, g, p] * right[r, n2, g, :]`` (read positions p only)
    in which a factor is infinite or NaN, as IEEE arithmetic adds them: NaN if one is NaN (0 * inf included) or
    infinities of both signs meet, else the infinity. Only the query rows holding such a value are classified
    (Compress: none in the usual case); per (row, position) the products over g are counted by kind with one MatMul
    of 0/1 indicators, and a key is flagged by a max-scatter (flags only go up, so repeated keys need no order)."""
    def kinds(x: str) -> dict[str, str]:
        zero = b.f32(0.0)
        inf = b.op("IsInf", x)
        return {"pos": b.op("Greater", x, zero), "neg": b.op("Less", x, zero), "zero": b.op("Equal", x, zero),
                "nan": b.op("IsNaN", x), "inf": inf, "pos_inf": b.op("IsInf", x, detect_negative=0),
                "neg_inf": b.op("IsInf", x, detect_positive=0)}

    def has(flags: str) -> str:                                                        # (rows, ...) -> (rows,)
        return b.op("Greater", b.op("ReduceMax", b.to_float(flags), b.ints(1, 2, 3), keepdims=0), b.f32(0.5))

    def ones(flag: str) -> str:                                                        # 0/1 indicator
        return b.to_float(flag)

    bad_row = b.op("Or", has(b.op("Not", b.op("Equal", b.op("Sub", weights, weights), b.f32(0.0)))),
                   has(b.op("Not", b.op("Equal", b.op("Sub", right, right), b.f32(0.0)))))
    w = kinds(b.op("Transpose", b.op("Compress", weights, bad_row, axis=0), perm=[0, 1, 3, 2]))   # (R', N2, Lp, G)
    v = kinds(b.op("Compress", right, bad_row, axis=0))                                          # (R', N2, G, W)
    w_pos_finite = b.op("And", w["pos"], b.op("Not", w["inf"]))
    w_neg_finite = b.op("And", w["neg"], b.op("Not", w["inf"]))
    nothing = b.op("Sub", ones(v["zero"]), ones(v["zero"]))
    one = b.op("Add", nothing, b.f32(1.0))
    v_inf = ones(v["inf"])
    # kind of w * v:       (+inf, -inf, NaN) per row of the stacked right-hand side
    table = [(w["pos_inf"], (ones(v["pos"]), ones(v["neg"]), ones(v["zero"]))),
             (w["neg_inf"], (ones(v["neg"]), ones(v["pos"]), ones(v["zero"]))),
             (w_pos_finite, (ones(v["pos_inf"]), ones(v["neg_inf"]), nothing)),
             (w_neg_finite, (ones(v["neg_inf"]), ones(v["pos_inf"]), nothing)),
             (w["zero"], (nothing, nothing, v_inf)),
             (w["nan"], (nothing, nothing, one)),
             (b.op("Not", w["nan"]), (nothing, nothing, ones(v["nan"])))]   # any w with a NaN v (w NaN counted above)
    left = b.concat(*(ones(flag) for flag, _ in table), axis=3)                                 # (R', N2, Lp, 7G)
    right_kinds = b.concat(*(b.concat(*row, axis=3) for _, row in table), axis=2)                # (R', N2, 7G, 3W)
    counts = b.op("MatMul", left, right_kinds)                                                   # (R', N2, Lp, 3W)
    read = b.unsqueeze(b.op("Compress", valid, bad_row, axis=0), 3)
    flags = b.op("And", b.op("Greater", counts, b.f32(0.5)), read)
    keys = b.dim(finite_sum, 0)                                   # T2*N2; one spare row takes the unflagged entries
    width = b.dim(counts, -1)
    flagged_rows = b.op("Expand", b.unsqueeze(b.op("Compress", flat, bad_row, axis=0), 3), b.op("Shape", flags))
    target = b.where(flags, flagged_rows, keys)
    zeros = b.op("ConstantOfShape", b.concat(b.op("Add", keys, b.ints(1)), width),
                 value=helper.make_tensor("", TensorProto.FLOAT, [1], [0]))
    per_key = b.op("ScatterElements", zeros, b.reshape(target, -1, width), b.reshape(ones(flags), -1, width), axis=0,
                   reduction="max")
    per_key = b.op("Greater", b.reshape(b.slice(per_key, b.ints(0), keys, 0), keys, 3, -1), b.f32(0.5))
    pos, neg, nan = (b.op("Squeeze", b.slice(per_key, b.ints(i), b.ints(i + 1), 1), b.ints(1)) for i in range(3))
    nan = b.op("Or", nan, b.op("And", pos, neg))
    term = b.where(nan, b.f32(np.nan), b.where(pos, b.f32(np.inf), b.f32(-np.inf)))
    return b.where(b.op("Or", nan, b.op("Or", pos, neg)), b.op("Add", finite_sum, term), finite_sum)


def _common(b: Body, spec: LoweringSpec, layout: str, is_grad: bool, kv: dict[str, str] = _DENSE_KV):
    rows = _Rows(b, spec, layout, honor_bsnd_lengths=not is_grad, kv=kv)
    flat, valid, span, _ = rows.candidates()
    kv_heads = b.dim("key", -2)
    group = b.op("Div", b.dim("query", -2), kv_heads)
    keys = b.op("Gather", _table(b, spec, ("key", "key_rope"), kv), flat, axis=0)       # (rows, N2, Lp, Dq)
    keys = _only_valid(b, keys, valid)
    queries = _table(b, spec, ("query", "query_rope"))
    queries = b.reshape(queries, rows.rows_total, kv_heads, group, b.dim(queries, -1))  # (rows, N2, G, Dq)
    scale = b.attr_float("scale_value")
    scores = b.op("Mul", b.op("MatMul", queries, b.op("Transpose", keys, perm=[0, 1, 3, 2])), scale)
    mask = b.unsqueeze(valid, 2)                                                       # (rows, N2, 1, Lp)
    masked = b.where(mask, scores, b.f32(-np.inf))
    return rows, flat, valid, mask, keys, queries, scale, masked, kv_heads, group


def _stats_to_layout(b: Body, layout: str, stats: str, rows: _Rows) -> str:
    if layout == "BSND":
        shaped = b.reshape(stats, b.dim("query", 0), b.dim("query", 1), b.dim(stats, 1), b.dim(stats, 2))
        return b.op("Transpose", shaped, perm=[0, 2, 1, 3])
    return b.op("Transpose", stats, perm=[1, 0, 2])


@register_lowering(FORWARD, ("layout_query", "layout_kv", "sparse_mode", "return_softmax_lse"))
def sfa_forward(b: Body, spec: LoweringSpec) -> None:
    layout = spec.attr("layout_query")
    kv = _paged_kv(b, spec, layout) if spec.attr("layout_kv") == PAGED else _DENSE_KV
    rows, flat, valid, mask, keys, queries, scale, masked, kv_heads, group = _common(b, spec, layout, False, kv)
    values = _only_valid(b, b.op("Gather", _table(b, spec, ("value",), kv), flat, axis=0), valid)  # (rows, N2, Lp, D2)
    row_max = b.op("ReduceMax", masked, b.ints(3), keepdims=1)
    nan_seen = _any_key(b, b.op("IsNaN", masked))
    if spec.has("sinks"):
        sinks = b.reshape(b.to_float("sinks"), 1, kv_heads, group, 1)
        row_max = b.op("Max", row_max, sinks)
        nan_seen = b.op("Or", nan_seen, b.op("IsNaN", sinks))
    # NumPy's max (the spec's) returns NaN when a score or the sink is NaN; ONNX Runtime's ReduceMax / Max skip it
    row_max = b.where(nan_seen, b.f32(np.nan), row_max)
    zero, one = b.f32(0.0), b.f32(1.0)
    # a row without a key has the spec's own values (out 0, max the sink or 0, sum 1 or 0); every other row
    # follows the formula in IEEE arithmetic, an infinite or NaN maximum included
    empty = b.op("Not", _any_key(b, mask))
    shift = b.where(empty, zero, row_max)
    e = b.op("Exp", b.op("Sub", masked, shift))
    total = b.sum(e, 3, keepdims=1)
    if spec.has("sinks"):
        total = b.op("Add", total, b.op("Exp", b.op("Sub", sinks, shift)))
    probs = b.op("Div", e, b.where(empty, one, total))
    row_max = b.where(empty, sinks if spec.has("sinks") else zero, row_max)
    total = b.where(empty, one if spec.has("sinks") else zero, total)
    out = b.op("MatMul", b.round_trip(probs, "query"), values)                        # (rows, N2, G, D2)
    computed = rows.active if spec.attr("sparse_mode") == 0 else b.op(
        "And", rows.active, b.op("Greater", rows.threshold, b.ints(0)))
    computed = b.unsqueeze(computed, 1, 2, 3)
    out = b.where(computed, out, zero)
    out_shape = b.concat(b.op("Shape", "query", end=-1), b.dim("value", -1))
    b.output("CastLike", "attention_out", b.op("Reshape", out, out_shape), "query")
    if spec.attr("return_softmax_lse"):
        for name, stat in (("softmax_max", row_max), ("softmax_sum", total)):
            stat = b.op("Squeeze", b.where(computed, stat, zero), b.ints(3))           # (rows, N2, G)
            b.output("Identity", name, _stats_to_layout(b, layout, stat, rows))
    else:
        empty = helper.make_tensor("", TensorProto.FLOAT, [1], [0])
        for name in ("softmax_max", "softmax_sum"):
            b.output("ConstantOfShape", name, b.ints(0), value=empty)


@register_lowering(GRAD, ("layout", "sparse_mode"))
def sfa_grad(b: Body, spec: LoweringSpec) -> None:
    layout = spec.attr("layout")
    rows, flat, valid, mask, keys, queries, scale, masked, kv_heads, group = _common(b, spec, layout, True)
    d2 = b.dim("d_out", -1)
    values = (_only_valid(b, b.op("Gather", _table(b, spec, ("value",)), flat, axis=0), valid) if spec.has("value")
              else b.slice(keys, b.ints(0), d2, 3))                                   # KV merge: V = key[..., :D2]

    def to_rows(name: str) -> str:
        """Stats (B, N2, S1, G) / (N2, T1, G) -> (rows, N2, G, 1)."""
        if layout == "BSND":
            stat = b.op("Transpose", name, perm=[0, 2, 1, 3])
        else:
            stat = b.op("Transpose", name, perm=[1, 0, 2])
        return b.reshape(stat, rows.rows_total, kv_heads, group, 1)

    zero = b.f32(0.0)
    with_max = b.op("Exp", b.op("Sub", masked, to_rows("softmax_max")))
    # P = exp(scale S - max) / sum in IEEE arithmetic, as the spec: a NaN or zero sum of a row that reads keys is
    # not hidden; a row that reads none divides by 1 (its P is 0 either way, and 0 / 0 would only raise warnings
    # in evaluators such as onnx.reference)
    probs = b.where(mask, b.op("Div", with_max, b.where(_any_key(b, mask), to_rows("softmax_sum"), b.f32(1.0))), zero)
    grad_out = b.reshape(b.to_float("d_out"), rows.rows_total, kv_heads, group, d2)
    out = b.reshape(b.to_float("out"), rows.rows_total, kv_heads, group, d2)
    d_p = b.op("MatMul", grad_out, b.op("Transpose", values, perm=[0, 1, 3, 2]))
    d_s = b.op("Mul", probs, b.op("Sub", d_p, b.sum(b.op("Mul", grad_out, out), 3, keepdims=1)))
    d_s = b.round_trip(b.where(mask, d_s, zero), "query")
    d_query = b.op("Mul", scale, b.op("MatMul", d_s, keys))                          # (rows, N2, G, Dq)
    # dK and dV: each row's weights are written along the key axis of a dense per-segment matrix (a row's
    # valid positions are distinct, every invalid one goes to a spare column, weights there are 0), then
    # one MatMul per segment sums over query rows: no two writes to one element, a fixed summation order.
    columns = b.op("Expand", b.unsqueeze(rows.key_columns(valid), 2), b.op("Shape", d_s))    # (rows, N2, G, Lp)
    segments, seg_rows, seg_keys = rows.segments()
    dense_shape = b.concat(b.op("Shape", d_s, end=3), b.op("Add", seg_keys, b.ints(1)))
    zeros = b.op("ConstantOfShape", dense_shape, value=helper.make_tensor("", TensorProto.FLOAT, [1], [0]))

    def accumulate(weights: str, right: str) -> str:
        """sum over query rows r and heads g of weights[r, n2, g, j] * right[r, n2, g, :] -> key layout (T2, N2, .).

        The dense product meets every key a row does not read with weight 0, so it runs on the finite values only
        and the terms with an infinity or NaN are added per key afterwards (``_non_finite_terms``)."""
        finite_weights, finite_right = _finite_only(b, weights), _finite_only(b, right)
        dense = b.op("ScatterElements", zeros, columns, finite_weights, axis=3)        # (rows, N2, G, C)
        dense = b.reshape(dense, segments, seg_rows, kv_heads, group, b.dim(dense, -1))
        dense = b.reshape(b.op("Transpose", dense, perm=[0, 2, 4, 1, 3]), segments, kv_heads, b.dim(dense, -1), -1)
        lhs = b.reshape(finite_right, segments, seg_rows, kv_heads, group, b.dim(right, -1))
        lhs = b.reshape(b.op("Transpose", lhs, perm=[0, 2, 1, 3, 4]), segments, kv_heads, -1, b.dim(right, -1))
        summed = b.slice(b.op("MatMul", dense, lhs), b.ints(0), seg_keys, 2)             # (segments, N2, keys, .)
        finite_sum = b.reshape(b.op("Transpose", summed, perm=[0, 2, 1, 3]), -1, b.dim(right, -1))  # (T2*N2, .)
        return _non_finite_terms(b, weights, right, valid, flat, finite_sum)

    d_key_all = b.op("Mul", scale, accumulate(d_s, queries))
    d_value_all = accumulate(b.round_trip(probs, "query"), grad_out)
    dq_width = b.dim(d_query, -1)
    if not spec.has("value"):                                                          # KV merge: dK[:, :D2] += dV
        d_key_all = b.concat(b.op("Add", b.slice(d_key_all, b.ints(0), d2, 1), d_value_all),
                             b.slice(d_key_all, d2, dq_width, 1), axis=1)
    d = b.dim("query", -1)
    d_query = b.reshape(d_query, rows.rows_total, b.dim("query", -2), b.dim(d_query, -1))

    def emit(name: str, table: str, start: str, end: str, like: str) -> None:
        part = b.slice(table, start, end, -1)
        shape = b.concat(b.op("Shape", like, end=-1), b.op("Shape", part, start=-1))
        b.output("CastLike", spec.out(name), b.op("Reshape", part, shape, allowzero=1), "query")

    emit("d_query", d_query, b.ints(0), d, "query")
    emit("d_key", d_key_all, b.ints(0), d, "key")
    emit("d_value", d_value_all, b.ints(0), d2, "key")
    emit("d_query_rope", d_query, d, dq_width, "query")
    emit("d_key_rope", d_key_all, d, dq_width, "key")
