"""The paged KV cache of SparseFlashAttention (spec 4.11), stated once: where each logical key lives.

Logical key j of batch b is row ``block_table[b, j // page] * page + j % page`` of the cache flattened to
(block_num * page, N2, .). The kernels run the dense problem the cache stands for, but never build its keys:
``PagedKeys.cache_rows`` maps the logical key rows a selection reads to cache rows, so work and memory follow
the keys read, not ``max_blocks * page``. The run-time check reads which table entries the selection touches;
the ONNX body writes the same addressing with Gather and is tested against this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PagedKeys", "gather_dense", "paged_keys"]


@dataclass(frozen=True)
class PagedKeys:
    """The dense problem a paged cache stands for, as a map from its logical key rows to cache rows.

    Logical key rows are flattened as the dense problem's: BSND ``b * seq_kv + j`` with the nominal
    ``seq_kv = max_blocks * page``; TND ``t`` over the batches' keys laid end to end (``starts[b] + j``).
    ``lengths_kv`` are the dense problem's kv lengths: per batch for BSND (as given), cumulative for TND.
    """

    table: np.ndarray       # (B, max_blocks) int64, padding clamped into [0, block_num)
    page: int
    lengths_kv: np.ndarray
    starts: np.ndarray      # TND: first logical row of each batch; BSND: unused
    seq_kv: int             # BSND: max_blocks * page; TND: 0
    total: int              # logical key rows: B * seq_kv (BSND), sum of the lengths (TND)

    @property
    def max_keys(self) -> int:
        """Most keys of one batch in the dense problem (BSND S2, TND T2), which bounds the candidate grid."""
        return self.seq_kv if self.seq_kv else self.total

    def cache_rows(self, logical: np.ndarray) -> np.ndarray:
        """The cache row holding each logical key row (any shape, int64). Rows outside the dense problem, and
        keys past a batch's table, are clamped to some row in range: they stand for keys no selection reads
        (the run-time check guarantees that every key read has an in-range page)."""
        capacity = self.table.shape[1] * self.page
        rows = np.clip(logical, 0, max(self.total - 1, 0))
        if self.seq_kv:
            batch, j = np.divmod(rows, self.seq_kv)
        else:
            batch = np.minimum(np.searchsorted(self.lengths_kv, rows, side="right"), self.table.shape[0] - 1)
            j = np.clip(rows - self.starts[batch], 0, capacity - 1)
        column, offset = np.divmod(j, self.page)
        return self.table[batch, column] * self.page + offset


def paged_keys(layout_query: str, block_table: np.ndarray, lengths_kv: np.ndarray, page: int,
               block_num: int) -> PagedKeys:
    """The logical keys of a cache of ``block_num`` pages of ``page`` keys read through ``block_table`` with the
    per-batch key counts ``lengths_kv``; O(B * max_blocks) work, whatever the lengths."""
    table = np.clip(block_table.astype(np.int64), 0, max(block_num - 1, 0))
    per_batch = lengths_kv.astype(np.int64)
    if layout_query == "BSND":
        seq_kv = table.shape[1] * page
        return PagedKeys(table, page, per_batch, np.zeros_like(per_batch), seq_kv, table.shape[0] * seq_kv)
    ends = np.cumsum(per_batch)
    return PagedKeys(table, page, ends, ends - per_batch, 0, int(ends[-1]) if ends.size else 0)


def gather_dense(cache: np.ndarray | None, keys: PagedKeys) -> np.ndarray | None:
    """A (block_num, page, N2, d) cache as the dense (B * S2, N2, d) or (T2, N2, d) rows of its logical keys:
    the statement of the addressing, for tests (the kernels gather only the rows they read)."""
    if cache is None:
        return None
    return cache.reshape((-1,) + cache.shape[2:])[keys.cache_rows(np.arange(keys.total))]
