"""The paged KV cache of SparseFlashAttention (spec 4.11), stated once: where each logical key lives.

Logical key j of batch b is row ``block_table[b, j // page] * page + j % page`` of the cache flattened to
(block_num * page, N2, .). The NumPy kernel gathers the dense keys through these rows and runs the dense
math; the run-time check reads which table entries the selection touches; the ONNX body writes the same
addressing with Gather and is tested against this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DenseView", "dense_view", "gather_dense"]


@dataclass(frozen=True)
class DenseView:
    """The dense problem a paged cache stands for: cache rows of every logical key, and the kv lengths.

    BSND queries: ``rows`` (B, max_blocks * page) and ``lengths_kv`` per batch (as given).
    TND queries: ``rows`` (sum of the batches' key counts,) and ``lengths_kv`` cumulative.
    """

    rows: np.ndarray
    lengths_kv: np.ndarray
    seq_kv: int           # the dense S2 of a BSND query (max_blocks * page); 0 for TND


def dense_view(layout_query: str, block_table: np.ndarray, lengths_kv: np.ndarray, page: int,
               block_num: int) -> DenseView:
    """Cache rows of the logical keys; table entries outside [0, block_num) (padding) point at row 0, which
    the run-time check guarantees no selected key reads."""
    table = np.clip(block_table.astype(np.int64), 0, max(block_num - 1, 0))
    per_batch = lengths_kv.astype(np.int64)
    max_keys = table.shape[1] * page
    if layout_query == "BSND":
        j = np.arange(max_keys)
        return DenseView(table[:, j // page] * page + j % page, per_batch, max_keys)
    ends = np.cumsum(per_batch)
    t = np.arange(int(ends[-1]) if ends.size else 0)
    batch = np.searchsorted(ends, t, side="right")
    j = t - (ends[batch] - per_batch[batch])
    return DenseView(table[batch, j // page] * page + j % page, ends, 0)


def gather_dense(cache: np.ndarray | None, view: DenseView) -> np.ndarray | None:
    """A (block_num, page, N2, d) cache as the dense (B, S2, N2, d) or (T2, N2, d) tensor of its logical keys."""
    if cache is None:
        return None
    flat = cache.reshape((-1,) + cache.shape[2:])
    return flat[view.rows]
