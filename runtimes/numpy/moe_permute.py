"""NumPy kernels for MoeTokenPermute and MoeTokenPermuteGrad (schemas/moe_permute).

The forward is a stable argsort of the flattened expert ids and one row gather (bit copies, any token dtype); the
grad sums each token's K gradient rows in float32 (float64 for float64 inputs, the test hook), k in order from +0,
with one rounding, on blocks of tokens that stay in cache, run on the process's CPUs.

Preconditions (checked by the schemas' run-time validation before a runtime calls these): the grad's
``sorted_indices`` is a permutation of ``0..len-1``.
"""

from __future__ import annotations

import numpy as np

from ...schemas.moe_permute import schema as schemas
from ._kernels import kernel, output_buffer, take_rows
from ._parallel import parallel_for

__all__ = ["moe_token_permute", "moe_token_permute_grad"]

BLOCK_ELEMENTS = 1 << 18
"""Gradient elements summed per block of tokens (1 MiB of float32), as the unpermute's kernel."""


@kernel(schemas.FORWARD)
def moe_token_permute(tokens: np.ndarray, indices: np.ndarray, *, num_out_tokens: int = 0,
                      padded_mode: bool = False,
                      outputs: tuple[np.ndarray | None, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(permute_tokens, sorted_indices)``: ``row2slot = argsort(ids.reshape(-1), stable)``; row r (r < rows) is
    ``tokens[row2slot[r] // K]``; ``sorted_indices[row2slot[r]] = r``."""
    topk = indices.shape[1] if indices.ndim == 2 else 1
    ids = indices.reshape(-1)
    slots = ids.shape[0]
    row2slot = np.argsort(ids, kind="stable")
    sorted_indices = output_buffer(outputs, 1, (slots,), np.dtype(np.int32))
    sorted_indices[row2slot] = np.arange(slots, dtype=np.int32)
    rows = schemas.permuted_rows(num_out_tokens, slots)
    out = output_buffer(outputs, 0, (rows, *tokens.shape[1:]), tokens.dtype)
    if rows:
        take_rows(tokens, row2slot[:rows] // topk, out)
    return out, sorted_indices


@kernel(schemas.GRAD)
def moe_token_permute_grad(permuted_output_grad: np.ndarray, sorted_indices: np.ndarray, *, num_topk: int,
                           padded_mode: bool = False,
                           outputs: tuple[np.ndarray | None, ...] | None = None) -> np.ndarray:
    """``input_grad[t] = sum_k grad[sorted_indices[t*K + k]]`` over the rows that exist (``< R``), k in order."""
    grad = permuted_output_grad
    rows, hidden = grad.shape
    tokens = sorted_indices.shape[0] // num_topk
    cdt = np.dtype(np.float64 if grad.dtype == np.float64 else np.float32)
    out = output_buffer(outputs, 0, (tokens, hidden), grad.dtype)
    slots = sorted_indices.reshape(tokens, num_topk)
    step = max(1, BLOCK_ELEMENTS // max(1, hidden))
    blocks = [slice(t, min(t + step, tokens)) for t in range(0, tokens, step)]

    def run(chunk: list[slice]) -> None:
        taken = np.empty((step, hidden), grad.dtype)                  # this thread's buffers
        total = np.empty((step, hidden), cdt)
        for block in chunk:
            n = block.stop - block.start
            acc = total[:n]
            acc.fill(0)                                                # +0: a lone -0 row sums to +0
            for k in range(num_topk):
                r = slots[block, k]
                kept = r < rows
                if rows == 0 or not kept.any():
                    continue
                row = take_rows(grad, np.where(kept, r, 0), taken[:n]).astype(cdt, copy=False)
                if not kept.all():
                    row = np.where(kept[:, None], row, 0)
                acc += row
            np.copyto(out[block], acc, casting="unsafe")

    parallel_for(run, blocks)
    return out
