"""Conversions between MoE routing-index conventions and geir's (CANN's) ``sorted_indices``.

geir follows CANN: ``sorted_indices[t*K + k]`` is the row of the expert-sorted tensor that
holds slot (token t, choice k) -- slot -> row, token-major. Other frameworks store other
maps, and mixing them silently permutes rows (no validation can tell), so convert:

- ``row2slot`` (MindSpeed's eager path): row -> slot; the inverse permutation of ours.
- Megatron-LM: row -> token (``row2slot // K``); k is lost, so the expert ids are needed.
- TransformerEngine / grouped_gemm ``row_id_map``: slot -> row but k-major (slot k*T + t).

All functions take and return int32 NumPy arrays, and raise ValueError on inconsistent input.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "from_megatron",
    "from_row_to_slot",
    "from_transformer_engine",
    "sorted_indices_from_expert_ids",
    "to_row_to_slot",
    "to_transformer_engine",
]


def _permutation(values: np.ndarray, what: str) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim != 1 or not np.array_equal(np.sort(values), np.arange(values.size)):
        raise ValueError(f"{what} must be a permutation of 0..{values.size - 1}")
    return values.astype(np.int64)


def _inverse(perm: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.size)
    return inverse.astype(np.int32)


def sorted_indices_from_expert_ids(expert_ids: np.ndarray) -> np.ndarray:
    """geir's ``sorted_indices`` for top-K routing ``expert_ids`` (tokens, K).

    Rows are ordered by expert, ties by slot (a stable sort), as a token permutation by
    expert produces them.
    """
    expert_ids = np.asarray(expert_ids)
    if expert_ids.ndim != 2:
        raise ValueError(f"expert_ids must be (tokens, topK), got shape {expert_ids.shape}")
    row2slot = np.argsort(expert_ids.reshape(-1), kind="stable")
    return _inverse(row2slot)


def from_row_to_slot(row2slot: np.ndarray) -> np.ndarray:
    """From a row -> slot map (MindSpeed's eager ``sorted_indices``)."""
    return _inverse(_permutation(row2slot, "row2slot"))


def to_row_to_slot(sorted_indices: np.ndarray) -> np.ndarray:
    return _inverse(_permutation(sorted_indices, "sorted_indices"))


def from_megatron(row_to_token: np.ndarray, expert_ids: np.ndarray) -> np.ndarray:
    """From Megatron-LM's row -> token map, rebuilt with the routing ``expert_ids`` (tokens, K).

    Megatron's map drops k, so the slot order is rebuilt from ``expert_ids`` and checked
    against ``row_to_token``; a mismatch means the map came from another sort.
    """
    expert_ids = np.asarray(expert_ids)
    topk = expert_ids.shape[1]
    row2slot = np.argsort(expert_ids.reshape(-1), kind="stable")
    row_to_token = np.asarray(row_to_token)
    if row_to_token.shape != row2slot.shape or not np.array_equal(row2slot // topk, row_to_token):
        raise ValueError("row_to_token does not match a stable sort of expert_ids by expert; "
                         "pass the expert ids the permutation was built from")
    return _inverse(row2slot)


def from_transformer_engine(row_id_map: np.ndarray, topk: int) -> np.ndarray:
    """From TransformerEngine's k-major slot -> row map (slot k*T + t)."""
    row_id_map = _permutation(row_id_map, "row_id_map")
    if row_id_map.size % topk:
        raise ValueError(f"row_id_map of length {row_id_map.size} is not divisible by topK = {topk}")
    return row_id_map.reshape(topk, -1).T.reshape(-1).astype(np.int32)


def to_transformer_engine(sorted_indices: np.ndarray, topk: int) -> np.ndarray:
    sorted_indices = _permutation(sorted_indices, "sorted_indices")
    if sorted_indices.size % topk:
        raise ValueError(f"sorted_indices of length {sorted_indices.size} is not divisible by topK = {topk}")
    return sorted_indices.reshape(-1, topk).T.reshape(-1).astype(np.int32)
