"""NumPy kernels for MoeTokenUnpermute and MoeTokenUnpermuteGrad (spec 3.3).

Both work on blocks that stay in cache and run the blocks on the process's CPUs: the forward on
blocks of tokens, gathering their (tokens, topK, hidden) rows; the grad on blocks of output rows
in order, gathering only the dY rows they read. Gathers move whole rows (``np.take`` into a
buffer each thread keeps); the arithmetic is float32 (float64 for float64 inputs, the test hook)
with one rounding per output.

Preconditions (checked by the schema's run-time validation before a runtime calls these):
``sorted_indices`` is a permutation of ``0..len-1`` (slot t*K+k -> row).
"""

from __future__ import annotations

import functools

import numpy as np

from ...schemas import moe as schemas
from ._kernels import kernel, output_buffer, take_rows
from ._parallel import parallel_for

__all__ = ["einsum_adds_in_order", "moe_token_unpermute", "moe_token_unpermute_grad"]

BLOCK_ELEMENTS = 1 << 18
"""Gathered elements per token block (1 MiB of float32): measured best at T=8192, K=8, H=1024;
smaller blocks lose to per-call overhead, larger ones to L2 misses."""


@functools.cache
def einsum_adds_in_order(tokens: np.dtype, compute: np.dtype) -> bool:
    """Whether this NumPy's ``einsum("tk,tkh->th", w, x, dtype=compute)`` on ``tokens`` rows is the reference's sum:
    x widened, ``w[t,0]*x[t,0] + w[t,1]*x[t,1] + ...``, each product rounded, added in k order (probed once per
    pair of dtypes, in the form the forward calls it).

    It widens and sums in one pass where widening, multiplying and summing take three (17-27 % of the forward at
    T=8192 K=8 H=1024), but its inner loops are NumPy's build-time SIMD code: a build that fuses them into FMA (as
    NumPy's universal intrinsics can where FMA is in the baseline) rounds once less. Such a build keeps the separate
    passes, so the NumPy runtime's results are the reference's on every build."""
    rng = np.random.default_rng(0)
    for topk, hidden in ((1, 7), (2, 33), (3, 64), (8, 1000)):
        w = rng.random((3, topk)).astype(compute)
        x = rng.standard_normal((3, topk, hidden)).astype(tokens)
        if topk >= 2:      # -1 + (1 + 2^-7)(1 + 2^-12 + 2^-22): the product drops a 2^-29 that FMA would keep
            w[:, :2], x[:, 0], x[:, 1] = (1, 1 + 2.0 ** -12 + 2.0 ** -22), -1, 1 + 2.0 ** -7
        wide = x.astype(compute)
        sequential = w[:, 0, None] * wide[:, 0]
        for k in range(1, topk):
            sequential = sequential + w[:, k, None] * wide[:, k]
        try:
            summed = np.einsum("tk,tkh->th", w, x, dtype=compute, casting="safe")
        except TypeError:      # no safe cast from these rows to the compute dtype
            return False
        if not np.array_equal(summed, sequential):
            return False
    return True


def _compute_dtype(*arrays: np.ndarray | None) -> np.dtype:
    return np.dtype(np.float64 if any(a is not None and a.dtype == np.float64 for a in arrays) else np.float32)


def _token_blocks(tokens: int, per_token: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(1, per_token))
    return [slice(t, min(t + step, tokens)) for t in range(0, tokens, step)]


_FORWARD_DEFAULTS = {a.name: a.default for a in schemas.FORWARD.attributes}   # defaults come from the declarations
_GRAD_DEFAULTS = {a.name: a.default for a in schemas.GRAD.attributes}


@kernel(schemas.FORWARD)
def moe_token_unpermute(permuted_tokens: np.ndarray, sorted_indices: np.ndarray, probs: np.ndarray | None = None,
                        *, padded_mode: bool = _FORWARD_DEFAULTS["padded_mode"],
                        restore_shape: tuple[int, ...] = _FORWARD_DEFAULTS["restore_shape"],
                        outputs: tuple[np.ndarray | None, ...] | None = None) -> np.ndarray:
    """``out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]]``, summed in k order.

    Slots whose row is ``>= len(permuted_tokens)`` are dropped (their weights are not read: a NaN there
    does not propagate); with probs, zero weights are skipped (so NaN/Inf in those rows do not
    propagate), as CANN does.
    """
    rows_available, hidden = permuted_tokens.shape
    topk = probs.shape[1] if probs is not None else 1
    tokens = probs.shape[0] if probs is not None else sorted_indices.shape[0]   # topK 0: Tn empty sums, zeros
    cdt = _compute_dtype(permuted_tokens, probs)
    out = output_buffer(outputs, 0, (tokens, hidden), permuted_tokens.dtype)
    slots = sorted_indices.reshape(tokens, topk)

    blocks = _token_blocks(tokens, topk * hidden)
    per_block = blocks[0].stop - blocks[0].start if blocks else 0
    direct = out.dtype == cdt        # no rounding: the sums are written where they belong, not copied there
    fused = probs is not None and einsum_adds_in_order(permuted_tokens.dtype, cdt)

    def run(chunk: list[slice]) -> None:
        raw = np.empty((per_block, topk, hidden), permuted_tokens.dtype)   # this thread's gather buffer
        for block in chunk:
            rows = slots[block]
            keep = rows < rows_available
            if probs is not None:
                weights = probs[block].astype(cdt)
                keep &= weights != 0
            if rows_available == 0:
                out[block] = 0
                continue
            every = bool(keep.all())
            taken = take_rows(permuted_tokens, rows if every else np.where(keep, rows, 0), raw[: rows.shape[0]])
            gathered = taken if fused else taken.astype(cdt, copy=False)
            if not every:      # a skipped slot adds +0: its row and its weight (NaN on a dropped slot, say) are
                np.copyto(gathered, 0, where=~keep[:, :, None])     # never read, as the reference skips it
                if probs is not None:
                    weights[~keep] = 0
            into = out[block] if direct else None        # float32 sums land in the output itself
            if fused:   # widened, weighted and summed in one pass
                total = np.einsum("tk,tkh->th", weights, gathered, out=into, dtype=cdt, casting="safe")
            else:
                if probs is not None:
                    gathered *= weights[:, :, None]
                total = gathered.sum(axis=1, out=into)   # a reduction over a middle axis adds k = 0, 1, ... in order
            total += 0.0                   # the reference starts from +0: turn a lone -0 into +0
            if not direct:
                np.copyto(out[block], total, casting="unsafe")

    parallel_for(run, blocks)
    return out


@kernel(schemas.GRAD)
def moe_token_unpermute_grad(permuted_tokens: np.ndarray | None, unpermuted_tokens_grad: np.ndarray,
                             sorted_indices: np.ndarray, probs: np.ndarray | None = None, *,
                             padded_mode: bool = _GRAD_DEFAULTS["padded_mode"],
                             restore_shape: tuple[int, ...] = _GRAD_DEFAULTS["restore_shape"],
                             outputs: tuple[np.ndarray | None, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(permuted_tokens_grad, probs_grad)``.

    ``permuted_tokens_grad[s[t*K+k]] = rnd(dY[t] * probs[t, k])`` (a bit copy of dY without
    probs); ``probs_grad[t, k]`` is the float32 dot of dY[t] with the unweighted row
    ``permuted_tokens[s[t*K+k]]``; without probs it is zeros of shape (tokens, 1).
    """
    grad = unpermuted_tokens_grad
    tokens, hidden = grad.shape
    slots_total = sorted_indices.shape[0]
    out = output_buffer(outputs, 0, (slots_total, hidden), grad.dtype)
    if probs is None:
        out[sorted_indices] = grad
        zeros = output_buffer(outputs, 1, (tokens, 1), grad.dtype)
        zeros.fill(0)
        return out, zeros
    topk = probs.shape[1]
    cdt = _compute_dtype(permuted_tokens, grad, probs)
    probs_grad = output_buffer(outputs, 1, probs.shape, probs.dtype)
    slot_of_row = np.empty(slots_total, np.intp)
    slot_of_row[sorted_indices] = np.arange(slots_total)
    flat_probs, flat_probs_grad = probs.reshape(-1), probs_grad.reshape(-1)
    step = max(1, BLOCK_ELEMENTS // max(1, hidden))
    blocks = [slice(r, min(r + step, slots_total)) for r in range(0, slots_total, step)]

    def run(chunk: list[slice]) -> None:
        """Walks the output rows in order (as the native kernel): permuted_tokens is read and the output written
        in sequence, and only the (smaller) dY rows are gathered."""
        taken = np.empty((step, hidden), grad.dtype)                  # this thread's buffers
        weighted = np.empty((step, hidden), cdt) if grad.dtype != cdt else None
        for block in chunk:
            slot = slot_of_row[block]
            n = slot.size
            dy = take_rows(grad, slot // topk, taken[:n]).astype(cdt, copy=False)
            w = flat_probs[slot].astype(cdt)[:, None]
            if weighted is None:
                np.multiply(dy, w, out=out[block])
            else:
                np.copyto(out[block], np.multiply(dy, w, out=weighted[:n]), casting="unsafe")
            rows = permuted_tokens[block].astype(cdt, copy=False)
            flat_probs_grad[slot] = np.einsum("ij,ij->i", rows, dy)     # float32 dots over H

    parallel_for(run, blocks)
    return out, probs_grad
