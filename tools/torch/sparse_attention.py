"""torch_npu's sparse attention calls as ``geir::`` ops: ``npu_sparse_flash_attention`` and its grad.

Signatures and defaults are torch_npu's (issue 28's quotation of op-plugin's ``op_plugin_functions.yaml``; op-plugin's
op_api kernels ``npu_sparse_flash_attention`` / ``npu_sparse_flash_attention_grad`` agree on the order). What
op-plugin returns for absent outputs, and so do these: without ``return_softmax_lse`` the statistics are float32
``(0,)`` tensors (``at::empty({0}, ...kFloat)``), and the grad's absent rope gradients are ``(0,)`` tensors of the
query's / key's dtype (``at::empty({0}, query.options())``). Both compute with geir's NumPy kernels after the ops'
rules (``_bridge``): SparseFlashAttention(Grad), schema rules SA-S*/SG-* and data rules SA-D1 (lengths) and SA-D3
(block ids) with their rule ids.

torch.library refuses autograd on a custom op with keyword-only Tensor arguments, and torch_npu's forward has them
(block_table, the lengths, the rope parts, sinks). So ``geir::npu_sparse_flash_attention`` has torch_npu's exact
schema and a CompositeImplicitAutograd body that calls ``geir::sparse_flash_attention``, the same op with every
argument positional, which carries the fake kernel and the autograd: its backward calls
``geir::npu_sparse_flash_attention_grad`` with the forward's inputs, out and saved statistics (as op-plugin's
derivatives wire it), or, for the forms that op has no direct call for, through the restatements of
``attention_backward``: BSND with actual_seq_lengths (which the grad op ignores, SG-W1) as TND with a padding
batch per batch; a paged KV cache (PA_BSND, BSND or TND query) as the dense keys it stands for, the gradients
added back into the cache's pages (a page the table names twice accumulates; the paged forward returns no
statistics, PA-S5, so the backward recomputes them); sinks get their gradient from the saved statistics.
Training otherwise needs ``return_softmax_lse=True`` (the statistics the grad reads); a backward without them
is a RuntimeError saying so.
"""

from __future__ import annotations

from typing import Any

import torch

from ...ir._errors import GraphError
from ...schemas import sparse_attention as schemas
from . import attention_backward as backward
from ._bridge import call, to_numpy, to_torch

__all__ = ["npu_sparse_flash_attention", "npu_sparse_flash_attention_grad", "sparse_flash_attention"]

Tensor = torch.Tensor
INT64_MAX = 2**63 - 1
_FORWARD_ARGS = ("Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_kv=None, "
                 "Tensor? query_rope=None, Tensor? key_rope=None, int sparse_block_size=1, str layout_query=\"BSND\", "
                 "str layout_kv=\"BSND\", int sparse_mode=3, int pre_tokens=9223372036854775807, "
                 "int next_tokens=9223372036854775807, int attention_mode=0, bool return_softmax_lse=False, "
                 "Tensor? sinks=None")
_FORWARD_RESULT = "-> (Tensor, Tensor, Tensor)"


def _array(tensor: Tensor | None, name: str) -> Any:
    return None if tensor is None else to_numpy(tensor, name)


@torch.library.custom_op(
    "geir::sparse_flash_attention", mutates_args=(),
    schema=f"(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, float scale_value, {_FORWARD_ARGS}) "
           f"{_FORWARD_RESULT}")
def sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
                           block_table: Tensor | None = None, actual_seq_lengths_query: Tensor | None = None,
                           actual_seq_lengths_kv: Tensor | None = None, query_rope: Tensor | None = None,
                           key_rope: Tensor | None = None, sparse_block_size: int = 1, layout_query: str = "BSND",
                           layout_kv: str = "BSND", sparse_mode: int = 3, pre_tokens: int = INT64_MAX,
                           next_tokens: int = INT64_MAX, attention_mode: int = 0, return_softmax_lse: bool = False,
                           sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    # its doc, and npu_sparse_flash_attention's, are set at the end of the module (_RETURNS says what both return)
    arrays = [to_numpy(query, "query"), to_numpy(key, "key"), to_numpy(value, "value"),
              to_numpy(sparse_indices, "sparse_indices"), _array(block_table, "block_table"),
              _array(actual_seq_lengths_query, "actual_seq_lengths_query"),
              _array(actual_seq_lengths_kv, "actual_seq_lengths_kv"), _array(query_rope, "query_rope"),
              _array(key_rope, "key_rope"), _array(sinks, "sinks")]
    attributes = {"scale_value": scale_value, "sparse_block_size": sparse_block_size, "layout_query": layout_query,
                  "layout_kv": layout_kv, "sparse_mode": sparse_mode, "pre_tokens": pre_tokens,
                  "next_tokens": next_tokens, "attention_mode": attention_mode,
                  "return_softmax_lse": return_softmax_lse}
    out, row_max, row_sum = call(schemas.FORWARD, arrays, attributes)
    return to_torch(out), to_torch(row_max), to_torch(row_sum)


@sparse_flash_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float,
      block_table: Tensor | None = None, actual_seq_lengths_query: Tensor | None = None,
      actual_seq_lengths_kv: Tensor | None = None, query_rope: Tensor | None = None, key_rope: Tensor | None = None,
      sparse_block_size: int = 1, layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3,
      pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, attention_mode: int = 0,
      return_softmax_lse: bool = False, sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    stats_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32   # float64: the kernels' hook
    if not return_softmax_lse:
        shape: tuple[Any, ...] = (0,)
    else:
        n2 = key.shape[-2]
        g = query.shape[-2] // n2
        shape = (query.shape[0], n2, query.shape[1], g) if query.dim() == 4 else (n2, query.shape[0], g)
    return out, query.new_empty(shape, dtype=stats_dtype), query.new_empty(shape, dtype=stats_dtype)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    (query, key, value, indices, scale, block_table, lengths_q, lengths_kv, query_rope, key_rope, block,
     layout_query, layout_kv, mode, pre_tokens, next_tokens, attention_mode, with_stats, sinks) = inputs
    ctx.attributes = backward.Attributes(scale, block, layout_query, layout_kv, mode, pre_tokens, next_tokens,
                                         attention_mode, with_stats)
    ctx.refusal = backward.refusal(ctx.attributes, block_table is not None)
    ctx.save_for_backward(query, key, value, indices, block_table, lengths_q, lengths_kv, query_rope, key_rope, sinks,
                          *output)
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx: Any, d_out: Tensor, _max: Tensor | None, _sum: Tensor | None) -> tuple[Tensor | None, ...]:
    if ctx.refusal is not None:
        raise RuntimeError(f"geir.torch: npu_sparse_flash_attention's backward: {ctx.refusal}")
    sinks_need_grad = len(ctx.needs_input_grad) > 18 and ctx.needs_input_grad[18]   # trailing defaults: absent
    g = backward.backward(ctx.attributes, backward.Saved(*ctx.saved_tensors), d_out, sinks_need_grad)
    return (g.query, g.key, g.value, None, None, None, None, None, g.query_rope, g.key_rope, None, None, None, None,
            None, None, None, None, g.sinks)


sparse_flash_attention.register_autograd(_backward, setup_context=_setup)

torch.library.define(
    "geir::npu_sparse_flash_attention",
    f"(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, float scale_value, *, {_FORWARD_ARGS}) "
    f"{_FORWARD_RESULT}")


@torch.library.impl("geir::npu_sparse_flash_attention", "CompositeImplicitAutograd")
def _npu_sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                                scale_value: float, *, block_table: Tensor | None = None,
                                actual_seq_lengths_query: Tensor | None = None,
                                actual_seq_lengths_kv: Tensor | None = None, query_rope: Tensor | None = None,
                                key_rope: Tensor | None = None, sparse_block_size: int = 1,
                                layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3,
                                pre_tokens: int = INT64_MAX, next_tokens: int = INT64_MAX, attention_mode: int = 0,
                                return_softmax_lse: bool = False,
                                sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.geir.sparse_flash_attention(
        query, key, value, sparse_indices, scale_value, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
        query_rope, key_rope, sparse_block_size, layout_query, layout_kv, sparse_mode, pre_tokens, next_tokens,
        attention_mode, return_softmax_lse, sinks)


@torch.library.custom_op(
    "geir::npu_sparse_flash_attention_grad", mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, Tensor d_out, Tensor out, "
           "Tensor softmax_max, Tensor softmax_sum, float scale_value, int sparse_block_size, "
           "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? actual_seq_qlen=None, "
           "Tensor? actual_seq_kvlen=None, str? layout=\"BSND\", int? sparse_mode=3, "
           "int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807, int? attention_mode=0) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def npu_sparse_flash_attention_grad(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, d_out: Tensor,
                                    out: Tensor, softmax_max: Tensor, softmax_sum: Tensor, scale_value: float,
                                    sparse_block_size: int, query_rope: Tensor | None = None,
                                    key_rope: Tensor | None = None, actual_seq_qlen: Tensor | None = None,
                                    actual_seq_kvlen: Tensor | None = None, layout: str | None = "BSND",
                                    sparse_mode: int | None = 3, pre_tokens: int | None = INT64_MAX,
                                    next_tokens: int | None = INT64_MAX,
                                    attention_mode: int | None = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(d_query, d_key, d_value, d_query_rope, d_key_rope)`` of SparseFlashAttentionGrad; without rope parts the
    last two are ``(0,)`` tensors of query's and key's dtype, as torch_npu returns. pre_tokens, next_tokens and
    attention_mode do not change the math (the op ignores them)."""
    if softmax_max.numel() == 0 and query.numel() != 0:
        raise GraphError("npu_sparse_flash_attention_grad: softmax_max: expected the forward's statistics, got an "
                         "empty tensor (the forward needs return_softmax_lse=True for training)")
    arrays = [to_numpy(query, "query"), to_numpy(key, "key"), to_numpy(sparse_indices, "sparse_indices"),
              to_numpy(d_out, "d_out"), to_numpy(out, "out"), to_numpy(softmax_max, "softmax_max"),
              to_numpy(softmax_sum, "softmax_sum"), to_numpy(value, "value"),
              _array(actual_seq_qlen, "actual_seq_qlen"), _array(actual_seq_kvlen, "actual_seq_kvlen"),
              _array(query_rope, "query_rope"), _array(key_rope, "key_rope")]
    attributes = {"scale_value": scale_value, "sparse_block_size": sparse_block_size,
                  "layout": "BSND" if layout is None else layout,
                  "sparse_mode": 3 if sparse_mode is None else sparse_mode}
    d_q, d_k, d_v, d_qr, d_kr = call(schemas.GRAD, arrays, attributes)
    return (to_torch(d_q), to_torch(d_k), to_torch(d_v),
            query.new_empty((0,)) if d_qr is None else to_torch(d_qr),
            key.new_empty((0,)) if d_kr is None else to_torch(d_kr))


@npu_sparse_flash_attention_grad.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, d_out: Tensor, out: Tensor,
      softmax_max: Tensor, softmax_sum: Tensor, scale_value: float, sparse_block_size: int,
      query_rope: Tensor | None = None, key_rope: Tensor | None = None, actual_seq_qlen: Tensor | None = None,
      actual_seq_kvlen: Tensor | None = None, layout: str | None = "BSND", sparse_mode: int | None = 3,
      pre_tokens: int | None = INT64_MAX, next_tokens: int | None = INT64_MAX,
      attention_mode: int | None = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            query.new_empty((0,)) if query_rope is None else torch.empty_like(query_rope),
            key.new_empty((0,)) if key_rope is None else torch.empty_like(key_rope))


# -- the public names: each op's body straight from plain eager calls, the op itself otherwise (``_eager``); torch_npu's
# keyword-only form calls the positional op's body, as its CompositeImplicitAutograd kernel calls the positional op --
from ._eager import eager_first, registered_body  # noqa: E402

_RETURNS = """Returns ``(attention_out, softmax_max, softmax_sum)``, always three tensors (SparseFlashAttention's
outputs): attention_out has query's shape with value's last dim (D2) and query's dtype. With
``return_softmax_lse=True`` the statistics are float32 ``(B, N2, S1, G)`` (BSND query) or ``(N2, T1, G)`` (TND),
what the grad reads. With ``return_softmax_lse=False`` (the default; a paged cache allows only False, PA-S5) each
statistic is an empty float32 tensor of shape ``(0,)``, not None, as op-plugin returns them
(``at::empty({0}, ...kFloat)``). float64 inputs (the kernels' gradcheck path) give float64 statistics."""
_forward_body = registered_body(sparse_flash_attention)
_forward_body.__doc__ = ("``npu_sparse_flash_attention`` with every argument positional (the differentiable "
                         "form).\n\n" + _RETURNS)
npu_sparse_flash_attention = eager_first("npu_sparse_flash_attention", _forward_body, __name__)
npu_sparse_flash_attention.__doc__ = ("torch_npu's ``npu_sparse_flash_attention(query, key, value, sparse_indices, "
                                      "scale_value, *, ...)``: the arguments after scale_value by keyword.\n\n"
                                      + _RETURNS)
sparse_flash_attention = eager_first("sparse_flash_attention", _forward_body, __name__)
npu_sparse_flash_attention_grad = eager_first("npu_sparse_flash_attention_grad",
                                              registered_body(npu_sparse_flash_attention_grad), __name__)
