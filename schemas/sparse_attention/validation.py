"""Run-time data rules of the sparse attention ops (spec 4.8, 4.11): SA-D1, SF-D2, PA-D1, SA-D3.

Lengths first (cumulative TND lengths non-decreasing and within T; BSND and paged per-batch lengths in
range), then the block ids of every row the op reads, then the page ids those blocks are read through.
Vectorised over rows; the first violation is reported with its row, entry and value.
"""

from __future__ import annotations

import numpy as np

from ...ir._schema import DataContext
from ..index_bounds import largest_unsigned
from .layouts import attention_layout, is_paged
from .selection import candidates, query_rows

__all__ = ["validate"]


def validate(ctx: DataContext) -> None:
    """SA-D1 / SF-D2 / PA-D1 (lengths), then SA-D3 (the block ids of every row the op reads), then PA-D1 (the
    page ids those blocks are read through)."""
    is_grad = ctx.schema.op_type.endswith("Grad")
    layout = attention_layout(ctx)
    query, key, indices = ctx.array("query"), ctx.array("key"), ctx.array("sparse_indices")
    lengths = [ctx.array("actual_seq_lengths_query"), ctx.array("actual_seq_lengths_kv")]
    names = ("actual_seq_lengths_query", "actual_seq_lengths_kv")
    paged = is_paged(ctx)
    if paged:
        seq_q, seq_kv, lengths = _validate_paged_lengths(ctx, layout, query, lengths)
    elif layout == "TND":
        for name, values, limit, what in zip(names, lengths, (query.shape[0], key.shape[0]), ("T1", "T2")):
            _check_cumulative(ctx, name, values, limit, what)
        seq_q = seq_kv = 0
    else:
        seq_q, seq_kv = query.shape[1], key.shape[1]
        if is_grad:
            lengths = [None, None]
        for name, values, limit, what in zip(names, lengths, (seq_q, seq_kv), ("S1", "S2")):
            _check_per_batch(ctx, "SF-D2", name, values, limit, f"a length in [0, {limit}] ({what})")
    if (not paged and layout == "BSND" and lengths[0] is None and lengths[1] is None
            and _uniform_ids_clean(indices, seq_q, seq_kv, ctx.attr("sparse_mode"), ctx.attr("sparse_block_size"))):
        return
    rows_total = query.shape[0] * (seq_q if layout == "BSND" else 1)
    rows = query_rows(layout, rows_total, seq_q, seq_kv, lengths[0], lengths[1], ctx.attr("sparse_mode"))
    read = np.flatnonzero(rows.reads)
    if read.size == 0:
        return
    entries = indices.reshape(rows_total, indices.shape[-2], indices.shape[-1])[read]
    _check_block_ids(ctx, layout, seq_q, rows, read, entries)
    if paged:
        _check_pages_read(ctx, layout, seq_q, rows, read, entries)


def _uniform_ids_clean(indices: np.ndarray, seq_q: int, seq_kv: int, sparse_mode: int, block: int) -> bool:
    """Whether SA-D3 holds on every row when no lengths are given: every batch has S1 queries and S2 keys, so
    each row may name block ids in ``[0, ceil(S2 / block))``. Decided on the whole array without the per-row
    selection (a call on small shapes pays for each NumPy operation, not for the data). False (not proven, the
    per-row path below decides and names the first offender) when some row would read nothing (S2 = 0, or mode 3
    with S1 > S2: such rows' ids are not read, so not checked) or when an id is wrong."""
    if seq_kv == 0 or (sparse_mode != 0 and seq_kv < seq_q):
        return False
    if indices.size == 0:
        return True
    # -1 (padding) -> 0 and an id b -> b + 1; anything below -1, or wrapping past the top, reads as huge unsigned
    shifted = np.add(indices, 1, dtype=indices.dtype)
    if largest_unsigned(shifted) > -(-seq_kv // block):
        return False
    is_pad = shifted == 0
    if np.count_nonzero(is_pad[..., :-1] > is_pad[..., 1:]):     # padding followed by an id
        return False
    shifted.sort(axis=-1)                                      # padding first; an id twice ends up side by side
    return not np.count_nonzero((shifted[..., 1:] == shifted[..., :-1]) & (shifted[..., 1:] != 0))


def _check_per_batch(ctx: DataContext, rule: str, name: str, values: np.ndarray | None, limit: int,
                     expected: str) -> None:
    if values is None:
        return
    bad = np.flatnonzero((values < 0) | (values > limit))
    if bad.size:
        b = int(bad[0])
        ctx.fail(rule, f"{ctx.input_subject(name)} position {b}", expected, int(values[b]))


def _validate_paged_lengths(ctx: DataContext, layout: str, query: np.ndarray, lengths: list) -> tuple[int, int, list]:
    """PA-D1 on the per-batch key counts; the dense problem's (S1, S2, lengths) for the selection."""
    key, table = ctx.array("key"), ctx.array("block_table")
    capacity = table.shape[1] * key.shape[1]
    _check_per_batch(ctx, "PA-D1", "actual_seq_lengths_kv", lengths[1], capacity,
                     f"a key count in [0, {capacity}] (max_blocks * page = {table.shape[1]} * {key.shape[1]})")
    if layout == "TND":
        _check_cumulative(ctx, "actual_seq_lengths_query", lengths[0], query.shape[0], "T1")
        return 0, 0, [lengths[0], np.cumsum(lengths[1].astype(np.int64))]
    _check_per_batch(ctx, "SF-D2", "actual_seq_lengths_query", lengths[0], query.shape[1],
                     f"a length in [0, {query.shape[1]}] (S1)")
    return query.shape[1], capacity, lengths


def _row_subject(layout: str, seq_q: int, row: int, n2: int) -> str:
    return f"row (b={row // seq_q}, s1={row % seq_q}, n2={n2})" if layout == "BSND" else f"row (t={row}, n2={n2})"


def _check_block_ids(ctx: DataContext, layout: str, seq_q: int, rows, read: np.ndarray, entries: np.ndarray) -> None:
    """SA-D3: -1 or an in-range block id, padding only at the end, no id twice."""
    block = ctx.attr("sparse_block_size")
    blocks_available = (-(-rows.s2_len[read] // block))[:, None, None]
    is_pad = entries == -1
    out_of_range = ~is_pad & ((entries < 0) | (entries >= blocks_available))
    pad_inside = ~is_pad & (np.cumsum(is_pad, axis=-1) > 0)
    ordered = np.sort(entries, axis=-1)      # an unstable sort finds whether any id repeats, ten times faster
    if not (out_of_range.any() or pad_inside.any()
            or ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != -1)).any()):
        return
    bad = out_of_range | pad_inside | _repeated(entries, is_pad)
    r, n2, i = (int(v) for v in np.argwhere(bad)[0])
    row, value, nb = int(read[r]), int(entries[r, n2, i]), int(blocks_available[r, 0, 0])
    subject = f"{ctx.input_subject('sparse_indices')} {_row_subject(layout, seq_q, row, n2)} entry {i}"
    if out_of_range[r, n2, i]:
        ctx.fail("SA-D3", subject, f"-1 or a block id in [0, {nb}) (NB_b = ceil(S2b / {block}))", value)
    if pad_inside[r, n2, i]:
        ctx.fail("SA-D3", subject, "-1 (padding only after the last valid block id)", value)
    first = int(np.flatnonzero(entries[r, n2] == value)[0])
    ctx.fail("SA-D3", subject, f"a block id not listed before (NB_b = {nb})", f"{value}, already at entry {first}")


def _repeated(entries: np.ndarray, is_pad: np.ndarray) -> np.ndarray:
    """Where a block id occurs again after an earlier entry of its row (the later occurrences), -1 excluded."""
    order = np.argsort(entries, axis=-1, kind="stable")
    ordered = np.take_along_axis(entries, order, axis=-1)
    repeat_sorted = np.zeros_like(is_pad)
    repeat_sorted[..., 1:] = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != -1)
    repeated = np.zeros_like(is_pad)
    np.put_along_axis(repeated, order, repeat_sorted, axis=-1)
    return repeated


def _check_pages_read(ctx: DataContext, layout: str, seq_q: int, rows, read: np.ndarray, entries: np.ndarray) -> None:
    """PA-D1: every block_table entry a selected key is read through is a page id in [0, block_num)."""
    key, table = ctx.array("key"), ctx.array("block_table")
    page, block_num = key.shape[1], key.shape[0]
    positions, valid = candidates(entries, rows.threshold[read], ctx.attr("sparse_block_size"),
                                  int(rows.s2_len[read].max()))
    if layout == "BSND":
        batch = read // seq_q
    else:
        batch = np.searchsorted(ctx.array("actual_seq_lengths_query").astype(np.int64), read, side="right")
    columns = np.where(valid, positions // page, 0)
    pages = table.astype(np.int64)[batch[:, None, None], columns]
    bad = valid & ((pages < 0) | (pages >= block_num))
    if bad.any():
        r, n2, c = (int(v) for v in np.argwhere(bad)[0])
        b, column = int(batch[r]), int(columns[r, n2, c])
        ctx.fail("PA-D1", f"{ctx.input_subject('block_table')} entry (b={b}, column={column}), read by "
                 f"{_row_subject(layout, seq_q, int(read[r]), n2)}", f"a page id in [0, {block_num}) (block_num)",
                 int(table[b, column]))


def _check_cumulative(ctx: DataContext, name: str, values: np.ndarray, limit: int, what: str) -> None:
    subject = ctx.input_subject(name)
    if values[0] < 0:
        ctx.fail("SA-D1", f"{subject} position 0", "a first cumulative length >= 0", int(values[0]))
    drops = np.flatnonzero(np.diff(values.astype(np.int64)) < 0)
    if drops.size:
        b = int(drops[0]) + 1
        ctx.fail("SA-D1", f"{subject} position {b}", f"a non-decreasing value (>= {int(values[b - 1])})",
                 int(values[b]))
    if values[-1] > limit:
        ctx.fail("SA-D1", f"{subject} position {values.size - 1}", f"a last value <= {limit} ({what})",
                 int(values[-1]))
