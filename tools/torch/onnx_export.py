"""geir.torch's ops to ONNX: ``ai.cann`` nodes that ``geir.from_onnx`` maps back to their schemas.

``onnx_translation_table()`` is a ``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``: each
``torch.ops.geir`` op becomes the GE IR op it computes (``npu_moe_token_unpermute`` -> ``ai.cann::MoeTokenUnpermute``,
the attention's grad -> ``SparseFlashAttentionGrad`` with its inputs in GE IR order, ...), with the few standard ops
torch_npu's conventions add around it (a 0-d probs grad, empty rope grads, rows the forward dropped). A model
written for the NPU so becomes a geir graph node for node, without any fusion.

torch's exporter cannot translate a mutating custom op (it meets it as ``auto_functionalized_v2`` and fails), so
``export_onnx()`` first rewrites each in-place rotary call on a whole tensor into its functional twin
(``partial_rotary_mul``), which is the same value: ``functional_rotary(graph)`` does it on any FX graph (the
``torch.compile`` backend uses it too). A call on a view of a larger tensor is refused with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import onnx
import onnxscript
import torch
from onnxscript import opset18

from ...ir._core import CANN_DOMAIN, Graph
from ...ir._errors import GraphError
from ...ir._files import write_file
from ..onnx_import import from_onnx
from .moe import shape_attribute
from .rotary import rotary_attributes

__all__ = ["export_onnx", "functional_rotary", "onnx_translation_table", "quiet_exporter", "to_graph"]

op: Any = opset18
"""Standard ONNX ops for the few nodes around ours (typed loosely: the exporter traces them symbolically)."""
_CANN = onnxscript.values.Opset(CANN_DOMAIN, 1)
_INPLACE_ROTARY = {"inplace_partial_rotary_mul": "partial_rotary_mul",
                   "inplace_partial_rotary_mul_backward": "partial_rotary_mul_backward"}
"""Each in-place rotary op (mutating its first argument) -> its functional twin (same value, new tensor)."""


def _static_dim(value: Any, axis: int) -> int | None:
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) <= axis:
        return None
    dim = shape[axis]
    return dim if isinstance(dim, int) else None


def _empty_like_dtype(like: Any) -> Any:
    """A (0,) tensor of ``like``'s dtype (torch_npu's ``at::empty({0}, options)``)."""
    return op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[0])), like)


def _unpermute_attributes(padded_mode: bool, restore_shape: Sequence[int] | None) -> dict[str, Any]:
    return {"padded_mode": bool(padded_mode), **shape_attribute(restore_shape)}


def _unpermute(permuted_tokens: Any, sorted_indices: Any, probs: Any = None, padded_mode: bool = False,
               restore_shape: Sequence[int] | None = None) -> Any:
    return _CANN.MoeTokenUnpermute(permuted_tokens, sorted_indices, probs,
                                   **_unpermute_attributes(padded_mode, restore_shape))


def _unpermute_grad(permuted_tokens: Any, grad_unpermuted_tokens: Any, sorted_indices: Any, probs: Any = None,
                    padded_mode: bool = False, restore_shape: Sequence[int] | None = None) -> tuple[Any, Any]:
    rows, weights = _CANN.MoeTokenUnpermuteGrad(permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs,
                                                **_unpermute_attributes(padded_mode, restore_shape), _outputs=2)
    return rows, weights


def _unpermute_grad_v2(grad_unpermuted_tokens: Any, sorted_indices: Any, permuted_tokens_size_0: int,
                       permuted_tokens_dtype: Any, probs: Any = None, padded_mode: bool = False,
                       restore_shape: Sequence[int] | None = None, permuted_tokens: Any = None) -> tuple[Any, Any]:
    """MoeTokenUnpermuteGrad, with ``geir.torch``'s handling of rows the forward dropped: the saved rows padded
    with zero rows to one per slot, and the gradient cut back to ``permuted_tokens_size_0`` rows."""
    rows = int(permuted_tokens_size_0)
    slots = _static_dim(sorted_indices, 0)
    if permuted_tokens is not None and _static_dim(permuted_tokens, 0) != slots:
        missing = op.Sub(op.Shape(sorted_indices, start=0, end=1), op.Shape(permuted_tokens, start=0, end=1))
        pads = op.Concat(op.Constant(value_ints=[0, 0]), missing, op.Constant(value_ints=[0]), axis=0)
        permuted_tokens = op.Pad(permuted_tokens, pads)
    tokens_grad, weights = _CANN.MoeTokenUnpermuteGrad(
        permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs,
        **_unpermute_attributes(padded_mode, restore_shape), _outputs=2)
    if slots != rows:
        tokens_grad = op.Slice(tokens_grad, op.Constant(value_ints=[0]), op.Constant(value_ints=[rows]),
                               op.Constant(value_ints=[0]))
    if probs is None:
        weights = op.CastLike(op.Constant(value_float=0.0), grad_unpermuted_tokens)
    return tokens_grad, weights


def _permute(tokens: Any, indices: Any, num_out_tokens: int | None = None,
             padded_mode: bool = False) -> tuple[Any, Any]:
    rows, slots = _CANN.MoeTokenPermute(tokens, indices, num_out_tokens=int(num_out_tokens or 0),
                                        padded_mode=bool(padded_mode), _outputs=2)
    return rows, slots


def _permute_grad_v2(grad_permuted_tokens: Any, sorted_indices: Any, tokens_size_0: int, tokens_dtype: Any,
                     num_topK: int, padded_mode: bool = False) -> Any:  # noqa: N803 (torch_npu's name)
    """MoeTokenPermuteGrad on (rows, hidden): trailing hidden dims flattened around it, as the torch op does."""
    grad = grad_permuted_tokens
    rank = len(grad.shape) if getattr(grad, "shape", None) is not None else 2
    if rank != 2:
        grad = op.Reshape(grad, op.Constant(value_ints=[0, -1]))
    out = _CANN.MoeTokenPermuteGrad(grad, sorted_indices, num_topk=int(num_topK), padded_mode=bool(padded_mode))
    if rank != 2:
        trailing = op.Shape(grad_permuted_tokens, start=1)
        out = op.Reshape(out, op.Concat(op.Constant(value_ints=[int(tokens_size_0)]), trailing, axis=0))
    return out


def _attention(query: Any, key: Any, value: Any, sparse_indices: Any, scale_value: float, block_table: Any = None,
               actual_seq_lengths_query: Any = None, actual_seq_lengths_kv: Any = None, query_rope: Any = None,
               key_rope: Any = None, sparse_block_size: int = 1, layout_query: str = "BSND",
               layout_kv: str = "BSND", sparse_mode: int = 3, pre_tokens: int = 2**63 - 1,
               next_tokens: int = 2**63 - 1, attention_mode: int = 0, return_softmax_lse: bool = False,
               sinks: Any = None) -> tuple[Any, Any, Any]:
    out, row_max, row_sum = _CANN.SparseFlashAttention(
        query, key, value, sparse_indices, block_table, actual_seq_lengths_query, actual_seq_lengths_kv, query_rope,
        key_rope, sinks, scale_value=float(scale_value), sparse_block_size=int(sparse_block_size),
        layout_query=layout_query, layout_kv=layout_kv, sparse_mode=int(sparse_mode), pre_tokens=int(pre_tokens),
        next_tokens=int(next_tokens), attention_mode=int(attention_mode),
        return_softmax_lse=bool(return_softmax_lse), _outputs=3)
    return out, row_max, row_sum


def _attention_grad(query: Any, key: Any, value: Any, sparse_indices: Any, d_out: Any, out: Any, softmax_max: Any,
                    softmax_sum: Any, scale_value: float, sparse_block_size: int, query_rope: Any = None,
                    key_rope: Any = None, actual_seq_qlen: Any = None, actual_seq_kvlen: Any = None,
                    layout: str | None = "BSND", sparse_mode: int | None = 3, pre_tokens: int | None = None,
                    next_tokens: int | None = None, attention_mode: int | None = None) -> tuple[Any, ...]:
    """SparseFlashAttentionGrad in GE IR input order; pre_tokens, next_tokens and attention_mode are dropped, as
    the torch op drops them (the grad op ignores them); absent rope grads are (0,) tensors, as torch_npu's."""
    d_q, d_k, d_v, d_qr, d_kr = _CANN.SparseFlashAttentionGrad(
        query, key, sparse_indices, d_out, out, softmax_max, softmax_sum, value, actual_seq_qlen, actual_seq_kvlen,
        query_rope, key_rope, scale_value=float(scale_value), sparse_block_size=int(sparse_block_size),
        layout="BSND" if layout is None else layout, sparse_mode=3 if sparse_mode is None else int(sparse_mode),
        _outputs=5)
    return (d_q, d_k, d_v, d_qr if query_rope is not None else _empty_like_dtype(query),
            d_kr if key_rope is not None else _empty_like_dtype(key))


def _rotary(x: Any, r1: Any, r2: Any, rotary_mode: str = "interleave", partial_slice: Sequence[int] = (0, 0)) -> Any:
    return _CANN.InplacePartialRotaryMul(x, r1, r2, **rotary_attributes("partial_rotary_mul", rotary_mode,
                                                                         partial_slice))


def _rotary_grad(grad_output: Any, r1: Any, r2: Any, rotary_mode: str = "interleave",
                 partial_slice: Sequence[int] = (0, 0)) -> Any:
    return _CANN.InplacePartialRotaryMulGrad(grad_output, r1, r2, **rotary_attributes(
        "partial_rotary_mul_backward", rotary_mode, partial_slice))


_TRANSLATIONS: dict[str, Callable[..., Any]] = {
    "npu_moe_token_unpermute": _unpermute,
    "npu_moe_token_unpermute_grad": _unpermute_grad,
    "npu_moe_token_unpermute_grad_v2": _unpermute_grad_v2,
    "npu_moe_token_permute": _permute,
    "npu_moe_token_permute_grad_v2": _permute_grad_v2,
    "sparse_flash_attention": _attention,
    "npu_sparse_flash_attention_grad": _attention_grad,
    "partial_rotary_mul": _rotary,
    "partial_rotary_mul_backward": _rotary_grad,
}
"""``torch.ops.geir.<name>.default`` -> the function writing its ONNX nodes. ``npu_sparse_flash_attention``
needs none (torch decomposes it into ``sparse_flash_attention``), the in-place rotary ops need ``functional_rotary``."""


def onnx_translation_table() -> dict[Any, Callable[..., Any]]:
    """The ``custom_translation_table`` for ``torch.onnx.export(model, args, dynamo=True, ...)``: geir.torch's ops
    as ``ai.cann`` nodes. (A model using the in-place rotary ops needs ``export_onnx()``, which rewrites them first.)"""
    return {getattr(torch.ops.geir, name).default: function for name, function in _TRANSLATIONS.items()}


def functional_rotary(graph: torch.fx.Graph) -> int:
    """Rewrite each functionalised in-place rotary call (``auto_functionalized_v2`` of
    ``geir::inplace_partial_rotary_mul`` or its backward) into its functional twin; return how many.

    Exact when the op rotates a whole tensor (its base): the twin returns that tensor rotated. A call on a view of
    a larger tensor (``x[..., :64]`` rotated in place) is a GraphError: the twin would need a scatter back into
    the base, which this rewrite does not write."""
    hop = torch.ops.higher_order.auto_functionalized_v2
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop:
            continue
        mutable = node.args[0]
        name = getattr(mutable, "_opname", None) if getattr(mutable, "namespace", None) == "geir" else None
        twin = _INPLACE_ROTARY.get(name or "")
        if twin is None:
            continue
        kwargs = dict(node.kwargs)
        mutated = "x" if name == "inplace_partial_rotary_mul" else "grad_output"
        view_keys = sorted(k for k in kwargs if k.startswith(f"_{mutated}_") and k != f"_{mutated}_base_index")
        bases = kwargs.get("_all_bases", [])
        if view_keys or len(bases) != 1:
            raise GraphError(f"geir.torch: {name} rotates a view of a larger tensor in place ({', '.join(view_keys)}); "
                             "only a call on a whole tensor can be exported or compiled: rotate a contiguous copy "
                             "(x = x[..., a:b].clone()) or call partial_rotary_mul")
        with graph.inserting_before(node):
            functional = graph.call_function(getattr(torch.ops.geir, twin).default, (bases[0], kwargs["r1"], kwargs["r2"]),
                                             {"rotary_mode": kwargs.get("rotary_mode", "interleave"),
                                              "partial_slice": list(kwargs.get("partial_slice", [0, 0]))})
        for user in list(node.users):
            if user.op == "call_function" and user.args[1] == 1:   # the updated base; index 0 is the op's "()"
                functional.meta.update(user.meta)
                user.replace_all_uses_with(functional)
                graph.erase_node(user)
        if node.users:
            raise GraphError(f"geir.torch: {name}: an unexpected use of its functionalised call ({list(node.users)})")
        graph.erase_node(node)
        count += 1
    return count


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The exporter's notices that say nothing about this graph (training mode, which an aten graph does not
    have; its registry's missing torchvision; a deprecation inside torch) kept off the user's terminal."""
    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry.level
    registry.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
            yield
    finally:
        registry.setLevel(level)


def export_onnx(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None, *,
           path: str | os.PathLike[str] | None = None,
           dynamic_shapes: Any = None) -> onnx.ModelProto:
    """``model`` exported by torch's dynamo exporter with geir.torch's ops as ``ai.cann`` nodes (in-place rotary
    calls rewritten by ``functional_rotary``); written to ``path`` (atomically) when given."""
    with quiet_exporter():
        program = torch.export.export(model, args, dict(kwargs or {}), dynamic_shapes=dynamic_shapes, strict=False)
        program = program.run_decompositions({})   # functionalised: in-place calls become auto_functionalized_v2
        if functional_rotary(program.graph_module.graph):
            program.graph_module.recompile()
        onnx_program = torch.onnx.export(program, dynamo=True, custom_translation_table=onnx_translation_table(),
                                         verbose=False)
    if onnx_program is None:   # pragma: no cover - the dynamo exporter always returns a program
        raise GraphError("geir.torch.export_onnx: torch.onnx.export returned no program")
    model_proto = onnx_program.model_proto
    if path is not None:
        write_file(path, model_proto.SerializeToString())
    return model_proto


def to_graph(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None) -> Graph:
    """``model`` as a geir Graph: ``export_onnx()`` then ``geir.from_onnx`` (every node verified by its schema)."""
    return from_onnx(export_onnx(model, args, kwargs))
