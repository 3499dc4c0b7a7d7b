"""Float64 reference of MoeTokenPermute(Grad), written from the definitions with plain loops: a sort by
(id, slot) pairs, Python's own ``sorted``, and sums token by token. Nothing shared with the kernels."""

from __future__ import annotations

import numpy as np


def permute_reference(tokens, indices, num_out_tokens: int = 0):
    """(permute_tokens, sorted_indices): slots sorted by (expert id, slot); row r copies token row2slot[r] // K."""
    tokens = np.asarray(tokens)
    indices = np.asarray(indices)
    topk = indices.shape[1] if indices.ndim == 2 else 1
    ids = [int(v) for v in indices.reshape(-1)]
    slots = len(ids)
    row2slot = sorted(range(slots), key=lambda j: (ids[j], j))
    sorted_indices = np.zeros(slots, np.int32)
    for row, slot in enumerate(row2slot):
        sorted_indices[slot] = row
    if num_out_tokens == 0:
        rows = slots
    elif num_out_tokens > 0:
        rows = min(num_out_tokens, slots)
    else:
        rows = max(slots + num_out_tokens, 0)
    out = np.zeros((rows, *tokens.shape[1:]), tokens.dtype)
    for row in range(rows):
        out[row] = tokens[row2slot[row] // topk]
    return out, sorted_indices


def permute_grad_reference(grad, sorted_indices, topk: int):
    """input_grad[t] = sum over k of grad[sorted_indices[t*K + k]] for the rows that exist, in float64."""
    grad = np.asarray(grad, np.float64)
    slots = len(sorted_indices)
    out = np.zeros((slots // topk, grad.shape[1]))
    for t in range(slots // topk):
        for k in range(topk):
            row = int(sorted_indices[t * topk + k])
            if row < grad.shape[0]:
                out[t] += grad[row]
    return out
