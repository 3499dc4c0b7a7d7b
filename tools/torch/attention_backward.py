"""The backward of geir.torch's ``npu_sparse_flash_attention`` for every forward the grad op cannot take as it is.

SparseFlashAttentionGrad (spec 4.7) has one layout for query and KV, ignores BSND lengths (SG-W1), has no paged
form (4.11) and computes no gradient for sinks. Each of those forwards is still exactly a problem it computes:

- BSND with ``actual_seq_lengths``: the same rows as TND with two batches per batch, the real one (S1b queries,
  S2b keys) and a padding one (the other S1 - S1b queries and S2 - S2b keys) whose block ids are set to -1, so it
  reads no key. Query, key and value are reshaped, not copied; the block ids (masked) and the saved statistics
  (transposed to TND's (N2, T1, G)) are copied.
- Paged KV (``PA_BSND``): the dense keys it stands for, gathered through ``block_table`` into ``max_blocks * page``
  rows per batch (TND again: S2b real keys, the rest a padding batch), and each dense row's gradient added back
  to the cache row it came from (``index_add``, so a page named twice accumulates: in float32, from the grad op's
  rounded rows, so only such a page's gradient is rounded twice in float16/bfloat16). Table entries outside
  ``[0, block_num)`` are never read by the forward (PA-D1 checks every entry it reads); their rows get no gradient.
  The paged forward returns no statistics (PA-S5), so they are recomputed by the forward on the dense problem.
- Sinks: the statistics already include each sink's mass, so the grad op's P = exp(s - max) / sum and its
  rowsum(dO * O) term are exact with sinks (P sums to 1 - p_sink; the sink has no value row). The sink's own
  gradient is ``d_sink[h] = -sum over rows of p_sink * rowsum(dO * O)`` with ``p_sink = exp(sink[h] - max) / sum``
  (``sink_gradient``), over the rows the forward computed (sum != 0).

Every shape here follows the input shapes only (no length-dependent sizes), so FakeTensor tracing of the backward
(torch.compile, AOTAutograd) works. The forms that stay refused are in ``refusal``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...schemas import sparse_attention as schemas

__all__ = ["Attributes", "Gradients", "Saved", "backward", "refusal", "sink_gradient"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class Attributes:
    """The forward's non-tensor arguments that its backward reads."""

    scale: float
    block: int
    layout_query: str
    layout_kv: str
    mode: int
    pre_tokens: int
    next_tokens: int
    attention_mode: int
    with_stats: bool

    @property
    def paged(self) -> bool:
        return self.layout_kv == schemas.PAGED


@dataclass(frozen=True)
class Saved:
    """The forward's tensor inputs and outputs (statistics ``(0,)`` when it returned none)."""

    query: Tensor
    key: Tensor
    value: Tensor
    indices: Tensor
    block_table: Tensor | None
    lengths_q: Tensor | None
    lengths_kv: Tensor | None
    query_rope: Tensor | None
    key_rope: Tensor | None
    sinks: Tensor | None
    out: Tensor
    softmax_max: Tensor
    softmax_sum: Tensor


@dataclass(frozen=True)
class Gradients:
    """The gradients of the differentiable inputs (None where absent or not asked for)."""

    query: Tensor
    key: Tensor
    value: Tensor
    query_rope: Tensor | None
    key_rope: Tensor | None
    sinks: Tensor | None


def refusal(attributes: Attributes, has_block_table: bool) -> str | None:
    """Why this forward has no backward, or None. A paged forward recomputes its statistics; any other needs
    ``return_softmax_lse=True`` (as torch_npu's training does), and query and KV in one layout (the forward's own
    rule SA-S1c refuses anything else before a backward could be asked for)."""
    if attributes.paged or has_block_table:
        return None
    if not attributes.with_stats:
        return ("it was called without return_softmax_lse=True, and its grad reads the softmax statistics: "
                "pass return_softmax_lse=True for training")
    if attributes.layout_kv != attributes.layout_query:
        return (f"layout_query {attributes.layout_query!r} differs from layout_kv {attributes.layout_kv!r}; "
                "SparseFlashAttentionGrad has one layout for both")
    return None


@dataclass(frozen=True)
class _Tnd:
    """A forward restated in TND with cumulative int32 lengths, which the grad op computes exactly."""

    query: Tensor
    key: Tensor
    value: Tensor
    indices: Tensor
    query_rope: Tensor | None
    key_rope: Tensor | None
    lengths_q: Tensor
    lengths_kv: Tensor


def _cumulative_pairs(first: Tensor, second: Tensor) -> Tensor:
    """Cumulative int32 lengths of batches ``first[0], second[0], first[1], second[1], ...``."""
    return torch.stack([first, second], dim=1).reshape(-1).cumsum(0).to(torch.int32)


def _tokens(x: Tensor) -> Tensor:
    """(B, S, N, d) -> (B * S, N, d)."""
    return x.reshape((-1,) + tuple(x.shape[2:]))


def _maybe_tokens(x: Tensor | None) -> Tensor | None:
    return None if x is None else _tokens(x)


def _query_side(attributes: Attributes, saved: Saved) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Query, query_rope and block ids as TND rows, and the (real, padding) query counts of each batch.

    BSND: batch b's real rows are s1 < S1b, the padding rows get block ids -1 (they read no key, as in the forward,
    where they are outside every batch). TND: the rows stay; each batch is followed by an empty padding batch."""
    query, indices, lengths = saved.query, saved.indices, saved.lengths_q
    if attributes.layout_query == "TND":
        assert lengths is not None                                       # SA-S7 held in the forward
        counts = torch.diff(lengths.long(), prepend=lengths.new_zeros(1, dtype=torch.long))
        return query, saved.query_rope, indices, torch.stack([counts, torch.zeros_like(counts)])
    batches, seq = query.shape[:2]
    real = torch.full((batches,), seq, dtype=torch.long) if lengths is None else lengths.long()
    padding_rows = torch.arange(seq)[None, :] >= real[:, None]                          # (B, S1)
    masked = torch.where(padding_rows[:, :, None, None], indices.new_full((), -1), indices)
    return _tokens(query), _maybe_tokens(saved.query_rope), _tokens(masked), torch.stack([real, seq - real])


def _page_rows(table: Tensor, page: int, block_num: int) -> tuple[Tensor, Tensor]:
    """For each dense key row ``b * max_blocks * page + j``: the cache row it is read from (entries outside
    ``[0, block_num)``: row 0, never read) and the row its gradient goes to (those entries: a spare row
    ``block_num * page``)."""
    j = torch.arange(table.shape[1] * page)
    entry = table.long()[:, j // page]                                                  # (B, max_blocks * page)
    in_range = (entry >= 0) & (entry < block_num)
    row = entry * page + j % page
    read = torch.where(in_range, row, 0).reshape(-1)
    home = torch.where(in_range, row, block_num * page).reshape(-1)
    return read, home


def _as_tnd(attributes: Attributes, saved: Saved) -> tuple[_Tnd, Tensor | None]:
    """The forward as a TND problem, and for a paged cache the cache row each dense key row's gradient goes to."""
    query, query_rope, indices, query_counts = _query_side(attributes, saved)
    home = None
    if attributes.paged:
        table = saved.block_table
        assert table is not None and saved.lengths_kv is not None      # PA-S2, PA-S3 held in the forward
        block_num, page = saved.key.shape[:2]
        read, home = _page_rows(table, page, block_num)

        def dense(cache: Tensor) -> Tensor:
            return cache.reshape((-1,) + tuple(cache.shape[2:])).index_select(0, read)

        key, value = dense(saved.key), dense(saved.value)
        key_rope = None if saved.key_rope is None else dense(saved.key_rope)
        seq_kv = table.shape[1] * page
        real_kv = saved.lengths_kv.long()
    else:
        key, value, key_rope = _tokens(saved.key), _tokens(saved.value), _maybe_tokens(saved.key_rope)
        seq_kv = saved.key.shape[1]
        real_kv = (torch.full((saved.key.shape[0],), seq_kv, dtype=torch.long) if saved.lengths_kv is None
                   else saved.lengths_kv.long())
    problem = _Tnd(query, key, value, indices, query_rope, key_rope,
                   _cumulative_pairs(query_counts[0], query_counts[1]), _cumulative_pairs(real_kv, seq_kv - real_kv))
    return problem, home


def _to_tnd_stats(stats: Tensor) -> Tensor:
    """(B, N2, S1, G) -> (N2, B * S1, G)."""
    return stats.transpose(0, 1).reshape(stats.shape[1], -1, stats.shape[3])


def _key_gradient(grad: Tensor, like: Tensor, home: Tensor | None) -> Tensor:
    """A TND key-side gradient in ``like``'s shape: reshaped, or for a paged cache (``home``: the cache row of each
    dense row) each dense row added to its cache row, summed in float32 (float64) and rounded once."""
    if home is None:
        return grad.reshape(like.shape)
    accumulate = torch.float64 if like.dtype == torch.float64 else torch.float32
    rows = grad.new_zeros((like.shape[0] * like.shape[1] + 1, *grad.shape[1:]), dtype=accumulate)   # + spare row
    rows.index_add_(0, home, grad.to(accumulate))
    return rows[:-1].reshape(like.shape).to(like.dtype)


def sink_gradient(layout: str, out: Tensor, d_out: Tensor, softmax_max: Tensor, softmax_sum: Tensor,
                  sinks: Tensor) -> Tensor:
    """``d_sink[h] = -sum over rows of exp(sink[h] - max) / sum * rowsum(d_out * out)`` in ``sinks``' dtype.

    The forward's ``out`` is ``sum_j p_j v_j`` with ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink))``, so
    ``d out / d sink = -p_sink * out``. Rows the forward did not compute (statistics 0) contribute nothing; a row
    that selected no key has out 0 and contributes 0. Computed in float32 (float64 for the float64 path)."""
    wide = torch.float64 if torch.float64 in (out.dtype, sinks.dtype, softmax_max.dtype) else torch.float32
    order = (0, 2, 1, 3) if layout == "BSND" else (1, 0, 2)          # statistics -> (..., N2, G) per query row

    def per_head(stats: Tensor) -> Tensor:
        rows = stats.permute(order)
        return rows.reshape(*rows.shape[:-2], -1).to(wide)          # (..., N1), head h = n2 * G + g

    row_max, row_sum = per_head(softmax_max), per_head(softmax_sum)
    computed = row_sum != 0
    p_sink = torch.exp(sinks.to(wide) - row_max) / torch.where(computed, row_sum, 1)
    dot = (d_out.to(wide) * out.to(wide)).sum(-1)
    terms = torch.where(computed, p_sink * dot, 0)
    return (-terms.reshape(-1, sinks.shape[0]).sum(0)).to(sinks.dtype)


def backward(attributes: Attributes, saved: Saved, d_out: Tensor, sinks_need_grad: bool) -> Gradients:
    """The gradients of ``geir::sparse_flash_attention``'s differentiable inputs, through
    ``geir::npu_sparse_flash_attention_grad``: directly for BSND without lengths and for TND, through the TND
    restatement (``_as_tnd``) for BSND with lengths and for a paged cache."""
    a, s = attributes, saved
    grad_op = torch.ops.geir.npu_sparse_flash_attention_grad
    d_out = d_out.contiguous()
    bsnd_lengths = a.layout_query == "BSND" and (s.lengths_q is not None or s.lengths_kv is not None)
    if not a.paged and not bsnd_lengths:
        d_q, d_k, d_v, d_qr, d_kr = grad_op(
            s.query, s.key, s.value, s.indices, d_out, s.out, s.softmax_max, s.softmax_sum, a.scale, a.block,
            s.query_rope, s.key_rope, s.lengths_q, s.lengths_kv, a.layout_query, a.mode, a.pre_tokens,
            a.next_tokens, a.attention_mode)
        d_sinks = (sink_gradient(a.layout_query, s.out, d_out, s.softmax_max, s.softmax_sum, s.sinks)
                   if sinks_need_grad and s.sinks is not None else None)
        rope = s.query_rope is not None
        return Gradients(d_q, d_k, d_v, d_qr if rope else None, d_kr if rope else None, d_sinks)
    t, home = _as_tnd(a, s)
    d_out_t, out = (_tokens(d_out), _tokens(s.out)) if a.layout_query == "BSND" else (d_out, s.out)
    if a.paged:     # PA-S5: the paged forward returns no statistics; the dense forward gives them (and out, equal)
        out, row_max, row_sum = torch.ops.geir.sparse_flash_attention(
            t.query, t.key, t.value, t.indices, a.scale, None, t.lengths_q, t.lengths_kv, t.query_rope, t.key_rope,
            a.block, "TND", "TND", a.mode, a.pre_tokens, a.next_tokens, a.attention_mode, True, s.sinks)
    else:
        row_max, row_sum = _to_tnd_stats(s.softmax_max), _to_tnd_stats(s.softmax_sum)
    d_q, d_k, d_v, d_qr, d_kr = grad_op(
        t.query, t.key, t.value, t.indices, d_out_t, out, row_max, row_sum, a.scale, a.block, t.query_rope,
        t.key_rope, t.lengths_q, t.lengths_kv, "TND", a.mode, a.pre_tokens, a.next_tokens, a.attention_mode)
    d_sinks = (sink_gradient("TND", out, d_out_t, row_max, row_sum, s.sinks)
               if sinks_need_grad and s.sinks is not None else None)
    return Gradients(d_q.reshape(s.query.shape), _key_gradient(d_k, s.key, home), _key_gradient(d_v, s.value, home),
                     None if s.query_rope is None else d_qr.reshape(s.query_rope.shape),
                     None if s.key_rope is None else _key_gradient(d_kr, s.key_rope, home), d_sinks)
