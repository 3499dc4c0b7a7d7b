"""torch_npu's MoE token calls as ``geir::`` custom ops: unpermute, its two grads, permute and permute's grad.

Signatures and defaults are torch_npu's (op-plugin ``op_plugin_functions.yaml``, as quoted in torch_npu's
``register_sharding`` strategies for ``npu.npu_moe_token_*``); autograd is wired as op-plugin wires it: the
unpermute's backward calls ``npu_moe_token_unpermute_grad_v2`` (op-plugin saves the forward's inputs through
``_npu_moe_token_unpermute``), the permute's calls ``npu_moe_token_permute_grad_v2(grad, result1,
tokens.sym_size(0), tokens.scalar_type(), topK, padded_mode)`` (op-plugin's derivatives guide, "Pattern B").
Each computes with geir's NumPy kernels after the op's rules (``_bridge``): MoeTokenUnpermute(Grad),
MoeTokenPermute(Grad).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...ir._errors import GraphError
from ...schemas import moe as unpermute_schemas
from ...schemas.moe_permute import schema as permute_schemas
from ._bridge import call, to_numpy, to_torch

__all__ = ["npu_moe_token_permute", "npu_moe_token_permute_grad_v2", "npu_moe_token_unpermute",
           "npu_moe_token_unpermute_grad", "npu_moe_token_unpermute_grad_v2"]

Tensor = torch.Tensor


def shape_attribute(restore_shape: Sequence[int] | None) -> dict[str, Any]:
    """``restore_shape`` as the op's attribute; None (torch_npu's default) leaves the op's own default."""
    return {} if restore_shape is None else {"restore_shape": list(restore_shape)}


@torch.library.custom_op(
    "geir::npu_moe_token_unpermute", mutates_args=(),
    schema="(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, "
           "int[]? restore_shape=None) -> Tensor")
def npu_moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None,
                            padded_mode: bool = False, restore_shape: Sequence[int] | None = None) -> Tensor:
    """``out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]]`` (MoeTokenUnpermute)."""
    arrays = [to_numpy(permuted_tokens, "permuted_tokens"), to_numpy(sorted_indices, "sorted_indices"),
              None if probs is None else to_numpy(probs, "probs")]
    out = call(unpermute_schemas.FORWARD, arrays, {"padded_mode": padded_mode, **shape_attribute(restore_shape)})
    return to_torch(out)


@npu_moe_token_unpermute.register_fake
def _(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None, padded_mode: bool = False,
      restore_shape: Sequence[int] | None = None) -> Tensor:
    tokens = probs.shape[0] if probs is not None else sorted_indices.shape[0]
    return permuted_tokens.new_empty((tokens, permuted_tokens.shape[1]))


def _grad_arrays(permuted_tokens: Tensor | None, grad: Tensor, sorted_indices: Tensor,
                 probs: Tensor | None) -> list[Any]:
    return [None if permuted_tokens is None else to_numpy(permuted_tokens, "permuted_tokens"),
            to_numpy(grad, "grad_unpermuted_tokens"), to_numpy(sorted_indices, "sorted_indices"),
            None if probs is None else to_numpy(probs, "probs")]


@torch.library.custom_op(
    "geir::npu_moe_token_unpermute_grad", mutates_args=(),
    schema="(Tensor permuted_tokens, Tensor grad_unpermuted_tokens, Tensor sorted_indices, Tensor? probs=None, "
           "bool padded_mode=False, int[]? restore_shape=None) -> (Tensor, Tensor)")
def npu_moe_token_unpermute_grad(permuted_tokens: Tensor, grad_unpermuted_tokens: Tensor, sorted_indices: Tensor,
                                 probs: Tensor | None = None, padded_mode: bool = False,
                                 restore_shape: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """``(permuted_tokens_grad, probs_grad)`` of MoeTokenUnpermuteGrad; without probs the second is the kernel's
    zeros of shape (tokens, 1), as ``geir.run`` gives them."""
    arrays = _grad_arrays(permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs)
    rows, weights = call(unpermute_schemas.GRAD, arrays, {"padded_mode": padded_mode,
                                                          **shape_attribute(restore_shape)})
    return to_torch(rows), to_torch(weights)


@npu_moe_token_unpermute_grad.register_fake
def _(permuted_tokens: Tensor, grad_unpermuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None,
      padded_mode: bool = False, restore_shape: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    grad = grad_unpermuted_tokens
    rows = grad.new_empty((sorted_indices.shape[0], grad.shape[1]))
    return rows, probs.new_empty(probs.shape) if probs is not None else grad.new_empty((grad.shape[0], 1))


def _check_row_count(rows: Any, slots: Any) -> None:
    """MG-S3 on grad_v2's ``permuted_tokens_size_0``: the forward's row count, in [0, len(sorted_indices)] (a negative
    one would otherwise be read as a slice from the end); the same on real and fake tensors. Symbolic sizes (a
    traced call) get torch._check guards, not a Python bool, which an unbacked size cannot give."""
    if not (isinstance(rows, int) and isinstance(slots, int)):
        torch._check(rows >= 0, lambda: f"[MG-S3] permuted_tokens_size_0: expected >= 0, got {rows}")
        torch._check(rows <= slots, lambda: f"[MG-S3] permuted_tokens_size_0: expected <= {slots}, got {rows}")
    elif not 0 <= rows <= slots:
        raise GraphError(f"[MG-S3] npu_moe_token_unpermute_grad_v2: permuted_tokens_size_0: expected a row count in "
                         f"[0, {slots}] (len(sorted_indices)), got {rows}", rule="MG-S3")


@torch.library.custom_op(
    "geir::npu_moe_token_unpermute_grad_v2", mutates_args=(),
    schema="(Tensor grad_unpermuted_tokens, Tensor sorted_indices, SymInt permuted_tokens_size_0, "
           "ScalarType permuted_tokens_dtype, Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None, "
           "Tensor? permuted_tokens=None) -> (Tensor, Tensor)")
def npu_moe_token_unpermute_grad_v2(grad_unpermuted_tokens: Tensor, sorted_indices: Tensor,
                                    permuted_tokens_size_0: int, permuted_tokens_dtype: torch.dtype,
                                    probs: Tensor | None = None, padded_mode: bool = False,
                                    restore_shape: Sequence[int] | None = None,
                                    permuted_tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The unpermute's backward: ``(permuted_tokens_grad, probs_grad)``, the first of shape
    (permuted_tokens_size_0, hidden); without probs the second is a 0-d tensor (as torch_npu returns).

    Rows dropped by the forward (``permuted_tokens_size_0 < len(sorted_indices)``: slots whose row is past the
    last) get no gradient and their weights a zero one: the kernel runs on ``permuted_tokens`` padded with zero rows
    to ``len(sorted_indices)`` and the padding is cut off the result."""
    grad = grad_unpermuted_tokens
    slots, rows = sorted_indices.shape[0], permuted_tokens_size_0
    if grad.dtype != permuted_tokens_dtype:
        raise GraphError(f"npu_moe_token_unpermute_grad_v2: grad_unpermuted_tokens: dtype: expected "
                         f"permuted_tokens_dtype {permuted_tokens_dtype}, got {grad.dtype}")
    _check_row_count(rows, slots)
    if permuted_tokens is not None and rows < slots and permuted_tokens.dim() == 2 and permuted_tokens.shape[0] == rows:
        # (another rank is MG-S3's error, which then shows the caller's shape, not the padded one)
        permuted_tokens = torch.cat([permuted_tokens, permuted_tokens.new_zeros(
            (slots - rows, *permuted_tokens.shape[1:]))])
    arrays = _grad_arrays(permuted_tokens, grad, sorted_indices, probs)
    out, weights = call(unpermute_schemas.GRAD, arrays, {"padded_mode": padded_mode,
                                                         **shape_attribute(restore_shape)})
    tokens_grad = to_torch(out)
    if rows < slots:
        tokens_grad = tokens_grad[:rows].clone()
    return tokens_grad, to_torch(weights) if probs is not None else grad.new_zeros(())


@npu_moe_token_unpermute_grad_v2.register_fake
def _(grad_unpermuted_tokens: Tensor, sorted_indices: Tensor, permuted_tokens_size_0: int,
      permuted_tokens_dtype: torch.dtype, probs: Tensor | None = None, padded_mode: bool = False,
      restore_shape: Sequence[int] | None = None, permuted_tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    grad = grad_unpermuted_tokens
    _check_row_count(permuted_tokens_size_0, sorted_indices.shape[0])
    tokens_grad = grad.new_empty((permuted_tokens_size_0, grad.shape[1]), dtype=permuted_tokens_dtype)
    return tokens_grad, probs.new_empty(probs.shape) if probs is not None else grad.new_empty(())


def _unpermute_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    permuted_tokens, sorted_indices, probs, padded_mode, restore_shape = inputs
    ctx.rows, ctx.dtype = permuted_tokens.shape[0], permuted_tokens.dtype
    ctx.padded_mode, ctx.restore_shape, ctx.has_probs = padded_mode, restore_shape, probs is not None
    ctx.save_for_backward(sorted_indices, probs, permuted_tokens if probs is not None else None)


def _unpermute_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    sorted_indices, probs, permuted_tokens = ctx.saved_tensors
    tokens_grad, probs_grad = torch.ops.geir.npu_moe_token_unpermute_grad_v2(
        grad.contiguous(), sorted_indices, ctx.rows, ctx.dtype, probs, ctx.padded_mode, ctx.restore_shape,
        permuted_tokens)
    return tokens_grad, None, probs_grad if ctx.has_probs else None, None, None


npu_moe_token_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


@torch.library.custom_op(
    "geir::npu_moe_token_permute", mutates_args=(),
    schema="(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False) -> (Tensor, Tensor)")
def npu_moe_token_permute(tokens: Tensor, indices: Tensor, num_out_tokens: int | None = None,
                          padded_mode: bool = False) -> tuple[Tensor, Tensor]:
    """``(permuted_tokens, sorted_indices)`` of MoeTokenPermute (None rows: all of them, as op-plugin's 0)."""
    arrays = [to_numpy(tokens, "tokens"), to_numpy(indices, "indices")]
    out, slots = call(permute_schemas.FORWARD, arrays, {"num_out_tokens": num_out_tokens or 0,
                                                        "padded_mode": padded_mode})
    return to_torch(out), to_torch(slots)


@npu_moe_token_permute.register_fake
def _(tokens: Tensor, indices: Tensor, num_out_tokens: int | None = None,
      padded_mode: bool = False) -> tuple[Tensor, Tensor]:
    slots = indices.shape[0] * (indices.shape[1] if indices.dim() == 2 else 1)
    rows = permute_schemas.permuted_rows(num_out_tokens or 0, slots)
    return tokens.new_empty((rows, *tokens.shape[1:])), indices.new_empty((slots,), dtype=torch.int32)


@torch.library.custom_op(
    "geir::npu_moe_token_permute_grad_v2", mutates_args=(),
    schema="(Tensor grad_permuted_tokens, Tensor sorted_indices, SymInt tokens_size_0, ScalarType tokens_dtype, "
           "int num_topK, bool padded_mode=False) -> Tensor")
def npu_moe_token_permute_grad_v2(grad_permuted_tokens: Tensor, sorted_indices: Tensor, tokens_size_0: int,
                                  tokens_dtype: torch.dtype, num_topK: int,  # noqa: N803 (torch_npu's name)
                                  padded_mode: bool = False) -> Tensor:
    """The permute's backward (MoeTokenPermuteGrad): token t's gradient sums its K rows' gradients; trailing
    hidden dims are flattened around the kernel, which takes (rows, hidden)."""
    grad = grad_permuted_tokens
    if grad.dtype != tokens_dtype:
        raise GraphError(f"npu_moe_token_permute_grad_v2: grad_permuted_tokens: dtype: expected tokens_dtype "
                         f"{tokens_dtype}, got {grad.dtype}")
    flat = grad.reshape(grad.shape[0], -1) if grad.dim() != 2 else grad
    arrays = [to_numpy(flat, "grad_permuted_tokens"), to_numpy(sorted_indices, "sorted_indices")]
    out = to_torch(call(permute_schemas.GRAD, arrays, {"num_topk": num_topK, "padded_mode": padded_mode}))
    if out.shape[0] != tokens_size_0:
        raise GraphError(f"npu_moe_token_permute_grad_v2: tokens_size_0: expected {out.shape[0]} "
                         f"(len(sorted_indices) / num_topK), got {tokens_size_0}")
    return out.reshape((tokens_size_0, *grad.shape[1:])) if grad.dim() != 2 else out


@npu_moe_token_permute_grad_v2.register_fake
def _(grad_permuted_tokens: Tensor, sorted_indices: Tensor, tokens_size_0: int, tokens_dtype: torch.dtype,
      num_topK: int, padded_mode: bool = False) -> Tensor:  # noqa: N803
    grad = grad_permuted_tokens
    return grad.new_empty((tokens_size_0, *grad.shape[1:]), dtype=tokens_dtype)


def _permute_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    tokens, indices, _, padded_mode = inputs
    ctx.tokens, ctx.dtype, ctx.padded_mode = tokens.shape[0], tokens.dtype, padded_mode
    ctx.topk = 1 if indices.dim() == 1 else indices.shape[1]
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _permute_backward(ctx: Any, grad: Tensor, _: Tensor | None) -> tuple[Tensor | None, ...]:
    (sorted_indices,) = ctx.saved_tensors
    tokens_grad = torch.ops.geir.npu_moe_token_permute_grad_v2(grad.contiguous(), sorted_indices, ctx.tokens,
                                                               ctx.dtype, ctx.topk, ctx.padded_mode)
    return tokens_grad, None, None, None


npu_moe_token_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


# -- the public names: each op's body straight from plain eager calls, the op itself otherwise (``_eager``) ----------
from ._eager import eager_first, registered_body  # noqa: E402

npu_moe_token_unpermute = eager_first("npu_moe_token_unpermute", registered_body(npu_moe_token_unpermute), __name__)
npu_moe_token_unpermute_grad = eager_first("npu_moe_token_unpermute_grad",
                                           registered_body(npu_moe_token_unpermute_grad), __name__)
npu_moe_token_unpermute_grad_v2 = eager_first("npu_moe_token_unpermute_grad_v2",
                                              registered_body(npu_moe_token_unpermute_grad_v2), __name__)
npu_moe_token_permute = eager_first("npu_moe_token_permute", registered_body(npu_moe_token_permute), __name__)
npu_moe_token_permute_grad_v2 = eager_first("npu_moe_token_permute_grad_v2",
                                            registered_body(npu_moe_token_permute_grad_v2), __name__)
