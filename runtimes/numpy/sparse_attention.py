"""NumPy kernels for SparseFlashAttention and SparseFlashAttentionGrad (spec 4.5-4.7).

Query rows are flattened (BSND ``b*S1 + s1``, TND ``t``) and processed in blocks. For a block,
each (row, KV head) gathers a padded set of at most ``K * sparse_block_size`` candidate keys
(never more than the keys that exist, ``candidate_grid``) with a
validity mask (``schemas.sparse_attention.selection``), so every product is a batched matmul over
(rows, KV heads) with the G query heads of a group as matrix rows; masked scores are -inf
and masked probabilities 0. The grad accumulates a block's key/value contributions either through
a dense GEMM over the block's key span or, when that span is wide, computes them per (row,
position) and scatter-adds them in rounds without repeated targets (``_scatter_add``), never
with ``np.add.at``. Both add in a fixed order, and the threads' partial sums are added in chunk
order: the same feeds give the same bits on every run with the same thread count.

Numerics as the spec states: float32 compute; forward P rounded to the input dtype before
P@V; grad P and dS rounded before their matmuls, scale applied in float32 (to dQ after its
product, to dS before the dK product), dK/dV summed in float32 and rounded once. float64 inputs
compute in float64 with no rounding (test hook).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...schemas import sparse_attention as schemas
from ...schemas.sparse_attention.paging import PagedKeys, paged_keys
from ...schemas.sparse_attention.selection import QueryRows, candidate_grid, candidates, query_rows

from ._kernels import kernel, take_rows
from ._parallel import parallel_for

__all__ = ["sparse_flash_attention", "sparse_flash_attention_grad"]

BLOCK_ELEMENTS = 1 << 20
"""Gathered key elements per block of query rows (4 MiB of float32). Blocks are the unit of work of
the threads (at the benchmark's shape: 25 blocks, so both CPUs get work; 1 << 22 made 7 blocks and
ran on one thread) and of the dK/dV scatter; 1 << 19 and 1 << 21 measured the same within noise."""


@dataclass
class _Problem:
    """The flattened tensors and row metadata shared by the forward and the grad."""

    layout: str
    query: np.ndarray        # (Q, N1, D + Dr) rows, input dtype
    key: np.ndarray          # (T2, N2, D + Dr) rows
    value: np.ndarray | None  # (T2, N2, D2) rows, or None (KV merge)
    indices: np.ndarray      # (Q, N2, K)
    rows: QueryRows
    d: int
    dtype: np.dtype
    cdt: np.dtype
    scale: np.floating
    block_size: int
    max_keys: int            # most keys of one batch (BSND S2, TND T2)
    key_rows: int            # logical key rows (B * S2 or T2; a paged cache's may be 0)
    pages: PagedKeys | None  # a paged cache: ``key``/``value`` hold its rows, read through this map

    @property
    def span(self) -> int:
        """Candidate keys gathered per (row, KV head), bounded by the keys that exist."""
        used, offsets = candidate_grid(self.indices.shape[-1], self.block_size, self.max_keys)
        return used * offsets

    @property
    def heads(self) -> tuple[int, int, int]:
        n1, n2 = self.query.shape[1], self.key.shape[1]
        return n1, n2, n1 // n2

    def rnd_in_place(self, x: np.ndarray) -> np.ndarray:
        """Round ``x`` (compute dtype) to the input dtype and widen it back, in place (identity in the
        float64 hook); returns ``x``."""
        if self.dtype != self.cdt:
            np.copyto(x, x.astype(self.dtype))
        return x

    def blocks(self, selected: np.ndarray) -> list[np.ndarray]:
        n2 = self.indices.shape[1]
        per_row = max(1, n2 * self.span * self.key.shape[2])
        step = max(1, BLOCK_ELEMENTS // per_row)
        return [selected[i : i + step] for i in range(0, selected.size, step)]

    def gather(self, qi: np.ndarray, scratch: _Scratch):
        """Everything one block of query rows needs, in compute dtype; keys and values live in ``scratch``
        (this thread's buffers, valid until its next gather)."""
        n1, n2, g = self.heads
        pos, valid = candidates(self.indices[qi], self.rows.threshold[qi], self.block_size, self.max_keys)
        kv = np.clip(self.rows.kv_start[qi][:, None, None] + pos, 0, max(self.key_rows - 1, 0))
        home = kv if self.pages is None else self.pages.cache_rows(kv)   # logical key row -> row of ``key``
        flat = home * n2 + np.arange(n2)[None, :, None]                  # rows of the (rows * N2, .) views
        keys = _gather_widened(self.key, flat, self.cdt, scratch, "keys")      # (nq, N2, Lp, D + Dr)
        values = None if self.value is None else _gather_widened(self.value, flat, self.cdt, scratch, "values")
        queries = self.query[qi].astype(self.cdt, copy=False).reshape(qi.size, n2, g, -1)
        return kv, valid, queries, keys, values

    def widen_keys(self, gathered_rows: int) -> None:
        """Widen key/value to the compute dtype once when the gathers would read each row more than once."""
        if self.key.dtype != self.cdt and gathered_rows >= self.key.shape[0] * self.key.shape[1]:
            self.key = self.key.astype(self.cdt)
            self.value = None if self.value is None else self.value.astype(self.cdt)


class _Scratch:
    """One thread's reusable buffers by name: a block's gathers land in memory the thread already touched,
    instead of fresh allocations whose first-touch page faults can cost more than the gather itself
    (a prototype of the forward at the bench shape: 111 ms of gathers into new arrays, 16 ms into these)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        size = int(np.prod(shape))
        buffer = self.buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.size < size:
            buffer = self.buffers[name] = np.empty(size, dtype)
        return buffer[:size].reshape(shape)


def _gather_widened(table: np.ndarray, flat_rows: np.ndarray, cdt: np.dtype, scratch: _Scratch, name: str) -> np.ndarray:
    """``table.reshape(-1, width)[flat_rows]`` in the compute dtype, in ``scratch`` (rows are clamped in range)."""
    width = table.shape[-1]
    shape = flat_rows.shape + (width,)
    rows = take_rows(table.reshape(-1, width), flat_rows, scratch.array(name + ".raw", shape, table.dtype))
    if table.dtype == cdt:
        return rows
    widened = scratch.array(name, shape, cdt)
    np.copyto(widened, rows)
    return widened


def _flatten(layout: str, x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None or layout == "TND" else x.reshape((-1,) + x.shape[2:])


def _with_rope(layout: str, x: np.ndarray, rope: np.ndarray | None) -> np.ndarray:
    x = _flatten(layout, x) if layout == "BSND" else x
    if rope is None:
        return x
    return np.concatenate([x, _flatten(layout, rope) if layout == "BSND" else rope], axis=-1)


def _problem(layout: str, query, key, value, indices, lengths_q, lengths_kv, query_rope, key_rope,
             scale_value: float, block_size: int, sparse_mode: int, pages: PagedKeys | None = None) -> _Problem:
    """The flattened problem; with ``pages``, key/value/key_rope are a paged cache's rows (block_num * page, N2, .)."""
    dtype = query.dtype
    cdt = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    q = _with_rope(layout, query, query_rope)
    if pages is None:
        seq_q, seq_kv = (query.shape[1], key.shape[1]) if layout == "BSND" else (0, 0)
        keys, values = _with_rope(layout, key, key_rope), _flatten(layout, value) if layout == "BSND" else value
        max_keys = seq_kv if layout == "BSND" else key.shape[0]
    else:
        seq_q, seq_kv = query.shape[1] if layout == "BSND" else 0, pages.seq_kv
        keys, values, max_keys = _with_rope("TND", key, key_rope), value, pages.max_keys
    rows = query_rows(layout, q.shape[0], seq_q, seq_kv, lengths_q, lengths_kv, sparse_mode)
    flat_indices = indices.reshape((q.shape[0],) + indices.shape[-2:])
    return _Problem(layout, q, keys, values, flat_indices, rows, query.shape[-1], dtype, cdt,
                    cdt.type(np.float32(scale_value)), block_size, max_keys,
                    keys.shape[0] if pages is None else pages.total, pages)


def _to_stats_layout(layout: str, rows_stats: np.ndarray, query_shape: tuple[int, ...]) -> np.ndarray:
    """(Q, N2, G) row-major stats -> (B, N2, S1, G) or (N2, T1, G)."""
    if layout == "BSND":
        b, s1 = query_shape[:2]
        return np.ascontiguousarray(rows_stats.reshape(b, s1, *rows_stats.shape[1:]).transpose(0, 2, 1, 3))
    return np.ascontiguousarray(rows_stats.transpose(1, 0, 2))


def _from_stats_layout(layout: str, stats: np.ndarray) -> np.ndarray:
    if layout == "BSND":
        return stats.transpose(0, 2, 1, 3).reshape(-1, *stats.shape[1:2], stats.shape[3])
    return stats.transpose(1, 0, 2)


@kernel(schemas.FORWARD)
def sparse_flash_attention(query, key, value, sparse_indices, block_table=None, actual_seq_lengths_query=None,
                           actual_seq_lengths_kv=None, query_rope=None, key_rope=None, sinks=None, *,
                           scale_value: float, sparse_block_size: int = 1, layout_query: str = "BSND",
                           layout_kv: str = "BSND", sparse_mode: int = 3, pre_tokens: int = 2**63 - 1, next_tokens: int = 2**63 - 1,
                           attention_mode: int = 0, return_softmax_lse: bool = False):
    """Return ``(attention_out, softmax_max, softmax_sum)``; the stats are (0,) without return_softmax_lse.

    A paged cache (``layout_kv`` PA_BSND) runs the dense problem it stands for (spec 4.11), its keys read through
    the block table as they are gathered: work and memory follow the keys read, not ``max_blocks * page``."""
    layout = layout_query
    pages = None
    if layout_kv == schemas.PAGED:
        pages = paged_keys(layout, block_table, actual_seq_lengths_kv, key.shape[1], key.shape[0])
        key, value, key_rope = (None if t is None else t.reshape((-1,) + t.shape[2:]) for t in (key, value, key_rope))
        actual_seq_lengths_kv = pages.lengths_kv
    p = _problem(layout, query, key, value, sparse_indices, actual_seq_lengths_query, actual_seq_lengths_kv,
                 query_rope, key_rope, scale_value, sparse_block_size, sparse_mode, pages)
    n1, n2, g = p.heads
    rows_total, d2 = p.query.shape[0], value.shape[-1]
    out = np.zeros((rows_total, n2, g, d2), p.cdt)
    row_max = np.zeros((rows_total, n2, g), p.cdt)
    row_sum = np.zeros((rows_total, n2, g), p.cdt)
    sink = None if sinks is None else sinks.astype(p.cdt).reshape(n2, g)
    computed = p.rows.active & ((p.rows.threshold > 0) | (sparse_mode == 0))
    p.widen_keys(int(computed.sum()) * n2 * p.span)

    def run(chunk: list[np.ndarray]) -> None:
        scratch = _Scratch()
        for qi in chunk:
            _, valid, queries, keys, values = p.gather(qi, scratch)
            masked = ~valid[:, :, None, :] if not valid.all() else None    # most blocks see K keys per row
            if masked is not None:     # positions not read hold clamped stand-in rows: 0, so P = 0 there adds 0
                values[~valid] = 0                                          # (not 0 * NaN) to the output
            scores = np.matmul(queries, keys.swapaxes(-1, -2), out=scratch.array("scores", queries.shape[:-1] + (
                keys.shape[-2],), p.cdt))                      # scores, then exponentials, then P, in place
            scores *= p.scale
            if masked is not None:
                np.copyto(scores, -np.inf, where=masked)
            m = scores.max(axis=-1)
            if sink is not None:
                m = np.maximum(m, sink)
            # a row without a key has the spec's own values (out 0; max the sink or 0, sum 1 or 0); every other
            # row follows the formula in IEEE arithmetic, an infinite or NaN maximum included
            empty = ~valid.any(axis=-1)[:, :, None] if masked is not None else None
            if empty is not None and not empty.any():
                empty = None
            shift = m if empty is None else np.where(empty, 0, m)
            np.subtract(scores, shift[..., None], out=scores)
            np.exp(scores, out=scores)
            total = scores.sum(axis=-1)
            if sink is not None:
                total += np.exp(sink - shift)
            scores /= (total if empty is None else np.where(empty, 1, total))[..., None]
            out[qi] = np.matmul(p.rnd_in_place(scores), values)
            if empty is not None:
                m = np.where(empty, 0 if sink is None else sink, m)
                total = np.where(empty, 0 if sink is None else 1, total)
            row_max[qi], row_sum[qi] = m, total

    parallel_for(run, p.blocks(np.flatnonzero(computed)))
    attention_out = out.reshape(query.shape[:-1] + (d2,)).astype(query.dtype)
    if not return_softmax_lse:
        empty = np.zeros((0,), np.float32 if p.cdt == np.float32 else p.cdt)
        return attention_out, empty, empty.copy()
    return (attention_out, _to_stats_layout(layout, row_max, query.shape),
            _to_stats_layout(layout, row_sum, query.shape))


def _conflict_free_rounds(targets: np.ndarray) -> list[np.ndarray]:
    """Split entry indices into rounds in which no two entries share a target: the i-th entry of each
    target (in index order) goes to round i, and each round lists its entries in ascending order.

    A fancy-index add over one round is then exact (it would drop repeated targets, so it cannot
    take a whole block at once), the rounds together add every entry in a fixed order (deterministic),
    and ascending entries read the contributions front to back. There are as many rounds as the
    most entries one target has (the block's rows sharing a key)."""
    if targets.size == 0:
        return []
    order = np.argsort(targets, kind="stable")
    ordered = targets[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    rank = np.empty(targets.size, np.intp)
    rank[order] = np.arange(targets.size) - np.repeat(starts, np.diff(np.append(starts, targets.size)))
    return np.split(np.argsort(rank, kind="stable"), np.cumsum(np.bincount(rank))[:-1])


def _scatter_add(target: np.ndarray, rows: np.ndarray, values: np.ndarray, picks: np.ndarray) -> None:
    """``target[rows[i]] += values[picks[i]]`` (whole rows), repeated rows summed in ``i`` order.

    Round by round, each a gather, an add and a scatter of whole rows: 1.5 ms for a block at the
    benchmark's shape (21 rows, 5376 contributions of 320 floats), where ``np.add.at`` takes 19 ms
    and a sort-and-``reduceat`` 15 ms."""
    for entries in _conflict_free_rounds(rows):
        at = rows[entries]
        rows_now = np.take(target, at, axis=0)
        rows_now += np.take(values, picks[entries], axis=0)
        target[at] = rows_now


DENSE_SPAN_RATIO = 32
"""Accumulate dK/dV of a block through dense matrices over its key span when
``span * G <= DENSE_SPAN_RATIO * K * block_size``; otherwise compute each (row, position)
contribution and scatter-add it (``_scatter_add``). The dense GEMM does span/(K*bs) times the
useful flops at ~0.015 ns per flop on one thread here; the scatter path costs ~1 ns per element
added plus its small-k products. Measured at the benchmark's shape (G = 16, span = 8 K, a block
of 21 rows): dense 6.8 ms, scatter 2.0 ms."""


class _DenseSpan:
    """Scatters per-(row, head, position) weights into a dense (N2, span, rows*G) matrix, kept per thread.

    The cells a block writes are the same for its dS and its P (the valid positions), and no
    two entries share a cell (a row's positions are distinct), so a plain ``put`` suffices;
    the buffer is cleared cell by cell afterwards instead of reallocated.
    """

    def __init__(self, dtype: np.dtype) -> None:
        self.buffer = np.zeros(0, dtype)

    def accumulate(self, acc: np.ndarray, kv: np.ndarray, valid: np.ndarray, lo: int, hi: int,
                   pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """For each (weights (nq, N2, G, Lp), rows (nq, N2, G, W)) pair, in order, add
        ``sum over (q, g) of weights[q, n2, g, l] * rows[q, n2, g]`` to ``acc[n2, kv, columns]``;
        the pairs' W widths tile the last axis of ``acc``."""
        nq, n2, g, _ = pairs[0][0].shape
        span, width = hi - lo, nq * g
        size = n2 * span * width
        if self.buffer.size < size:
            self.buffer = np.zeros(size, self.buffer.dtype)
        dense = self.buffer[:size].reshape(n2, span, width)
        q, head, pos = np.nonzero(valid)
        cells = ((head * span + (kv[q, head, pos] - lo)) * width + q * g)[:, None] + np.arange(g)
        start = 0
        for weights, rows in pairs:
            np.put(dense, cells, weights[q, head, :, pos])
            product = np.matmul(dense, rows.transpose(1, 0, 2, 3).reshape(n2, width, -1))
            acc[:, lo:hi, start:start + product.shape[-1]] += product
            start += product.shape[-1]
        np.put(dense, cells, 0)


@kernel(schemas.GRAD)
def sparse_flash_attention_grad(query, key, sparse_indices, d_out, out, softmax_max, softmax_sum, value=None,
                                actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                key_rope=None, *, scale_value: float, sparse_block_size: int = 1, layout: str = "BSND",
                                sparse_mode: int = 3, pre_tokens: int = 2**31 - 1, next_tokens: int = 2**31 - 1,
                                deterministic: bool = False):
    """Return ``(d_query, d_key, d_value, d_query_rope, d_key_rope)``; absent outputs are None."""
    lengths = (actual_seq_lengths_query, actual_seq_lengths_kv) if layout == "TND" else (None, None)
    p = _problem(layout, query, key, value, sparse_indices, *lengths, query_rope, key_rope, scale_value,
                 sparse_block_size, sparse_mode)
    n1, n2, g = p.heads
    rows_total, dq, d2 = p.query.shape[0], p.query.shape[-1], d_out.shape[-1]
    grad_rows = _flatten(layout, d_out) if layout == "BSND" else d_out
    out_rows = _flatten(layout, out) if layout == "BSND" else out
    stats_max = _from_stats_layout(layout, softmax_max).astype(p.cdt)
    stats_sum = _from_stats_layout(layout, softmax_sum).astype(p.cdt)
    d_q = np.zeros((rows_total, n2, g, dq), p.cdt)
    reads = np.flatnonzero(p.rows.reads)
    lp = p.span
    p.widen_keys(reads.size * n2 * lp)
    blocks = p.blocks(reads)
    accumulators: dict[int, np.ndarray] = {}   # first query row of a thread's chunk -> its [dK | dV]

    def run(chunk: list[np.ndarray]) -> None:
        if not chunk:                  # no row reads a key (e.g. every kv length 0): the sums stay 0 (spec 4.7)
            return
        acc = np.zeros((n2, p.key.shape[0], dq + d2), p.cdt)   # per thread: [dK | dV] of (head, key row)
        accumulators[int(chunk[0][0])] = acc
        dense, scratch = _DenseSpan(p.cdt), _Scratch()
        for qi in chunk:
            kv, valid, queries, keys, values = p.gather(qi, scratch)
            if not valid.all():        # positions not read hold clamped stand-in rows: 0, so no 0 * NaN reaches dQ
                unread = ~valid
                keys[unread] = 0
                if values is not None:
                    values[unread] = 0
            if values is None:                                  # KV merge: V = key[..., :D2]
                values = keys[..., :d2]
            nq = qi.size
            d_o = grad_rows[qi].astype(p.cdt).reshape(nq, n2, g, d2)
            o = out_rows[qi].astype(p.cdt).reshape(nq, n2, g, d2)
            masked = ~valid[:, :, None, :] if not valid.all() else None
            shape = queries.shape[:-1] + (keys.shape[-2],)
            probs = np.matmul(queries, keys.swapaxes(-1, -2), out=scratch.array("probs", shape, p.cdt))
            probs *= p.scale                                   # scores -> P in place
            if masked is not None:
                np.copyto(probs, -np.inf, where=masked)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                np.subtract(probs, stats_max[qi][..., None], out=probs)
                np.exp(probs, out=probs)
                probs /= stats_sum[qi][..., None]
            if masked is not None:
                np.copyto(probs, 0, where=masked)
            d_s = np.matmul(d_o, values.swapaxes(-1, -2), out=scratch.array("d_s", shape, p.cdt))
            d_s -= (d_o * o).sum(axis=-1)[..., None]           # dP - rowsum(dO O), then times P: dS
            d_s *= probs
            if masked is not None:
                np.copyto(d_s, 0, where=masked)
            p.rnd_in_place(d_s)
            p.rnd_in_place(probs)                              # only the rounded P is read from here on
            d_q[qi] = p.scale * np.matmul(d_s, keys)
            if not valid.any():
                continue
            lo, hi = int(kv[valid].min()), int(kv[valid].max()) + 1
            # the dense span multiplies every query row by 0 at the keys it does not read: only for finite rows
            if (hi - lo) * g <= DENSE_SPAN_RATIO * lp and np.isfinite(queries).all() and np.isfinite(d_o).all():
                dense.accumulate(acc, kv, valid, lo, hi, [(p.scale * d_s, queries), (probs, d_o)])
            else:
                both = scratch.array("dkv", kv.shape + (dq + d2,), p.cdt)        # (nq, N2, Lp, Dq + D2)
                np.matmul((p.scale * d_s).swapaxes(-1, -2), queries, out=both[..., :dq])   # scaled as the dense path
                np.matmul(probs.swapaxes(-1, -2), d_o, out=both[..., dq:])
                heads = np.arange(n2)[None, :, None]
                picks = np.flatnonzero(valid)
                _scatter_add(acc.reshape(-1, dq + d2), (heads * p.key.shape[0] + kv).reshape(-1)[picks],
                             both.reshape(-1, dq + d2), picks)

    parallel_for(run, blocks)
    partial = [accumulators[first] for first in sorted(accumulators)]   # chunk order, not finishing order
    acc = sum(partial[1:], partial[0]) if partial else np.zeros((n2, p.key.shape[0], dq + d2), p.cdt)
    acc = acc.transpose(1, 0, 2)
    d_key_all, d_value = acc[..., :dq], acc[..., dq:]
    if value is None:
        d_key_all = d_key_all.copy()
        d_key_all[..., :d2] += d_value
    d = p.d
    dt = query.dtype
    d_q = d_q.reshape(rows_total, n1, dq)

    def shaped(x: np.ndarray, like: np.ndarray) -> np.ndarray:
        return x.reshape(like.shape).astype(dt)

    return (shaped(d_q[..., :d], query), shaped(d_key_all[..., :d], key),
            None if value is None else shaped(d_value, value),
            None if query_rope is None else shaped(d_q[..., d:], query_rope),
            None if key_rope is None else shaped(d_key_all[..., d:], key_rope))
