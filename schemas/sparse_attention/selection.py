"""Which keys each query row of the sparse attention ops sees (spec 4.5), vectorised over rows.

Shared by the run-time validation (``sparse_attention``) and the kernels, so the selection
semantics are written once. Query rows are flattened: BSND row ``b*S1 + s1``, TND row ``t``;
key rows likewise (``b*S2 + j`` or ``t``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["QueryRows", "candidate_grid", "candidates", "query_rows"]


@dataclass(frozen=True)
class QueryRows:
    """Per flattened query row: its batch and the lengths and offsets that select its keys."""

    s1: np.ndarray         # position in its batch
    s1_len: np.ndarray     # S1b
    s2_len: np.ndarray     # S2b
    kv_start: np.ndarray   # flattened key row of the batch's first key
    threshold: np.ndarray  # keys j < threshold are visible
    active: np.ndarray     # the row belongs to a batch and s1 < S1b

    @property
    def reads(self) -> np.ndarray:
        """Rows whose sparse_indices the op reads (and validation checks)."""
        return self.active & (self.threshold > 0)


def query_rows(layout: str, query_rows_total: int, seq_q: int, seq_kv: int, lengths_q: np.ndarray | None,
               lengths_kv: np.ndarray | None, sparse_mode: int) -> QueryRows:
    """Row metadata; BSND lengths are per-batch (None: full), TND lengths are cumulative."""
    rows = np.arange(query_rows_total, dtype=np.int64)
    if layout == "BSND":
        batch, s1 = rows // seq_q, rows % seq_q
        s1_len = np.full_like(rows, seq_q) if lengths_q is None else lengths_q.astype(np.int64)[batch]
        s2_len = np.full_like(rows, seq_kv) if lengths_kv is None else lengths_kv.astype(np.int64)[batch]
        kv_start = batch * seq_kv
        active = s1 < s1_len
    else:
        aq, akv = lengths_q.astype(np.int64), lengths_kv.astype(np.int64)
        batch = np.searchsorted(aq, rows, side="right")
        active = batch < aq.size
        b = np.minimum(batch, aq.size - 1)
        q_start = np.where(b > 0, aq[b - 1], 0)
        kv_start = np.where(b > 0, akv[b - 1], 0)
        s1, s1_len, s2_len = rows - q_start, aq[b] - q_start, akv[b] - kv_start
    threshold = s2_len if sparse_mode == 0 else s2_len - s1_len + s1 + 1
    return QueryRows(s1, s1_len, s2_len, kv_start, threshold, active)


def candidate_grid(k: int, block_size: int, max_keys: int) -> tuple[int, int]:
    """(entries, offsets per entry) worth gathering for a row of ``k`` block ids when no batch has more
    than ``max_keys`` keys: entry i is read only if i < ceil(thr / bs) <= ceil(max_keys / bs), and an
    offset o of block b is visible only if b*bs + o < thr <= max_keys. So the work is bounded by the
    keys that exist, whatever ``sparse_block_size`` says."""
    keys = max(1, max_keys)
    return max(1, min(k, -(-keys // block_size))), min(block_size, keys)


def candidates(entries: np.ndarray, threshold: np.ndarray, block_size: int,
               max_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Key positions (relative to the batch) and their validity for rows of block ids.

    ``entries``: (rows, N2, K) block ids; ``threshold``: (rows,); ``max_keys``: most keys of a batch.
    Returns ``positions`` and ``valid`` of shape (rows, N2, E * O) with ``(E, O) = candidate_grid``:
    entry i counts when i < min(K, ceil(thr/bs)), no -1 precedes it, and a position counts when it
    is below the threshold. Block ids beyond the threshold never reach the multiply (no overflow).
    """
    used, offsets = candidate_grid(entries.shape[-1], block_size, max_keys)
    entries = entries[..., :used]
    thr = threshold[:, None, None]
    n_valid = np.where(thr > 0, np.minimum(used, -(-thr // block_size)), 0)
    entry_ok = (np.arange(used) < n_valid) & (np.cumprod(entries != -1, axis=-1) > 0)
    entry_ok &= (entries >= 0) & (entries <= (thr - 1) // block_size)
    safe = np.where(entry_ok, entries, 0).astype(np.int64)
    positions = safe[..., None] * block_size + np.arange(offsets)
    valid = entry_ok[..., None] & (positions < thr[..., None])
    shape = entries.shape[:-1] + (used * offsets,)
    return positions.reshape(shape), valid.reshape(shape)
