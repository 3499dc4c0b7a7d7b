"""``geir bench torch``: what a ``geir.torch`` call costs over the NumPy kernel it computes with (issue 28, item 1).

Each geir.torch function (the unpermute and its grad v2, the permute and its grad v2, sparse attention and its grad,
the in-place rotary and its backward) at its op family's bench shapes (``--quick``: their quick shapes) and at one
tiny shape, as rows of one case:

- ``NumPy kernel alone`` (the baseline): the op's NumPy kernel called directly on NumPy arrays with the attributes
  the call resolves, which is what the call computes with (the native C kernels have no direct call entry);
- ``geir.torch call``: the public function on tensors sharing those arrays' memory; held to at most
  ``CALL_TARGET`` times the kernel on the bench shapes and at most ``TINY_OVERHEAD_S`` over it on the tiny shape;
- ``geir.run numpy, caller buffers``: the same op as a one-node graph through ``geir.run``, writing reused buffers;
- ``PyTorch eager``: the same math in plain PyTorch ops (one batch, one KV head and block size 1 for attention);
- tiny shape only: ``NumPy kernel + data rules`` (the op's ``..-D#`` rules, which every call and ``geir.run`` run
  on the data: what of the overhead is the op's contract, not the glue), ``kernel + rules + tensor conversions``
  (that, plus what any call must do per tensor: the plain-tensor check and the NumPy view of each input, the
  tensor of each output, and the eager-mode check: the least a call that checks everything can cost; held to the
  call's target, so that where it misses, no call that checks every tensor and runs every rule can meet it) and
  ``torch.ops.geir (dispatcher)``, the registered op, which skips no dispatcher work.

The call and the kernel, and on the tiny shape every row, are timed interleaved (``Measurement.interleaved``), so
that their differences (a few microseconds on the tiny shape, a few percent on the bench shapes) are not drowned by
the machine's drift between rows timed seconds apart.

Part of ``geir.torch`` (it needs PyTorch): ``geir bench`` imports it only to run this suite, leaves the suite out
without PyTorch, and ``geir bench torch`` then says what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...runtimes.numpy._kernels import kernel_for
from ...schemas import moe, rotary, sparse_attention
from ...schemas.moe.examples import MoeCase
from ...schemas.moe_permute import examples as permute_examples
from ...schemas.moe_permute.examples import PermuteCase
from ...schemas.moe_permute.schema import FORWARD as PERMUTE, GRAD as PERMUTE_GRAD
from ...schemas.rotary.examples import RotaryCase
from ...schemas.sparse_attention.examples import SfaCase
from .. import torch as gt
from ..bench_torch_peers import torch_moe_grad, torch_sfa_grad
from ..bench_rows import Measurement
from ..builder import GraphBuilder
from ..facade import run
from ._bridge import prepare, to_numpy, to_torch
from ._eager import eager_ready, plain_tensor

__all__ = ["CALL_TARGET", "TINY", "TINY_OVERHEAD_S", "torch_measurements", "torch_permute", "torch_rotary_", "torch_sfa",
           "torch_unpermute"]

CALL_TARGET = 1.2
"""A geir.torch call on the bench shapes, as a multiple of the NumPy kernel alone."""
TINY_OVERHEAD_S = 30e-6
"""A geir.torch call on the tiny shape: at most this much longer than the NumPy kernel alone."""
KERNEL, CALL, RUN, EAGER, RULED, FLOOR, DISPATCHER = (
    "NumPy kernel alone", "geir.torch call", "geir.run numpy, caller buffers", "PyTorch eager",
    "NumPy kernel + data rules", "kernel + rules + tensor conversions", "torch.ops.geir (dispatcher)")
OP = "geir.torch"
CALLS = 1e9
"""The work of every row: one call (the table prints calls per second)."""


def _rows(function: str, case: str, tiny: bool, schema: Any, arrays: list[np.ndarray | None],
          attributes: dict[str, Any], call: Callable[[], object], dispatcher: Callable[[], object],
          eager: Callable[[], object], in_place: bool = False) -> list[Measurement]:
    """One case's rows: the kernel on ``arrays`` with the attributes the call resolves (``prepare`` of the call's
    own attributes), the call, ``geir.run`` of the op on the same arrays into reused buffers, PyTorch eager."""
    prepared = prepare(schema, arrays, attributes)
    resolved, rules = prepared.attributes, prepared.data_rules
    kernel = kernel_for(schema)
    extra = {"out": arrays[0]} if in_place else {}
    b = GraphBuilder(f"bench_torch_{schema.op_type}")
    feeds = {spec.name: a for spec, a in zip(schema.inputs, arrays) if a is not None}
    values = [None if a is None else b.input(spec.name, a.dtype, a.shape) for spec, a in zip(schema.inputs, arrays)]
    results = b.add_node(schema, values, resolved, name=schema.op_type)
    for spec, value in zip(schema.outputs, results if isinstance(results, tuple) else (results,)):
        if value is not None:
            b.output(value, "out_" + spec.name)
    graph = b.build()
    buffers = {k: np.empty_like(v) for k, v in run(graph, feeds).items()}
    target = {"overheads": ((KERNEL, TINY_OVERHEAD_S),)} if tiny else {"targets": ((KERNEL, CALL_TARGET),)}
    # the call and the kernel it wraps (and on the tiny shape every row) in the same rounds: Measurement.interleaved
    together, pair = {"interleaved": tiny}, {"interleaved": True}
    case = f"{function}, {case}"     # the op column is geir.torch: each function's rows are a case of their own
    rows = [Measurement(OP, case, KERNEL, lambda: kernel(*arrays, **resolved, **extra), CALLS, "calls/s",
                        baseline=True, **pair),
            Measurement(OP, case, CALL, call, CALLS, "calls/s", **target, **pair),
            Measurement(OP, case, RUN, lambda: run(graph, feeds, outputs=buffers), CALLS, "calls/s", **together),
            Measurement(OP, case, EAGER, eager, CALLS, "calls/s", **together)]
    if not tiny:
        return rows

    def ruled() -> object:
        if rules is not None:
            rules(arrays)
        return kernel(*arrays, **resolved, **extra)

    tensors = [to_torch(a) for a in arrays if a is not None]
    made = [] if in_place else [o for o in _as_list(ruled()) if o is not None]

    def converted() -> object:
        """``ruled`` with what a call does per tensor around it (its results are the kernel's, the tensors made
        from them are let go): the eager check, each input's check and NumPy view, each output's tensor. The
        rules and kernel read ``arrays``, the same memory as the views just made, at the same cost."""
        if not eager_ready():
            raise RuntimeError("geir bench torch: the conversions row needs plain eager mode")
        for t in tensors:
            if not plain_tensor(t):
                raise RuntimeError("geir bench torch: the conversions row needs plain CPU tensors")
            to_numpy(t, "input")
        found = ruled()
        for o in made:
            to_torch(o)
        return found
    return rows + [Measurement(OP, case, RULED, ruled, CALLS, "calls/s", **together),
                   Measurement(OP, case, FLOOR, converted, CALLS, "calls/s", **target, **together),
                   Measurement(OP, case, DISPATCHER, dispatcher, CALLS, "calls/s", **together)]


def _as_list(outputs: object) -> list[Any]:
    return [] if outputs is None else list(outputs) if isinstance(outputs, tuple) else [outputs]


def _tensors(arrays: dict[str, np.ndarray | None]) -> dict[str, torch.Tensor | None]:
    return {k: None if v is None else to_torch(v) for k, v in arrays.items()}


# -- MoE: unpermute and its grad v2 (one MoeCase), permute and its grad v2 (PermuteCases) ---------------------------
def torch_unpermute(rows: torch.Tensor, slots: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    tokens, topk = probs.shape
    gathered = rows.float()[slots.long()].view(tokens, topk, -1)
    return (gathered * probs.float()[:, :, None]).sum(1).to(rows.dtype)


def _unpermute_cases(spec: MoeCase, tiny: bool) -> list[Measurement]:
    a = spec.arrays()
    t = _tensors(a)
    rows, dy, slots, probs = t["permuted_tokens"], t["unpermuted_tokens_grad"], t["sorted_indices"], t["probs"]
    case = f"T={spec.tokens} K={spec.topk} H={spec.hidden} {spec.dtype}"
    ops = torch.ops.geir
    found = _rows("npu_moe_token_unpermute", case, tiny, moe.FORWARD,
                  [a["permuted_tokens"], a["sorted_indices"], a["probs"]], {"padded_mode": False},
                  lambda: gt.npu_moe_token_unpermute(rows, slots, probs),
                  lambda: ops.npu_moe_token_unpermute(rows, slots, probs), lambda: torch_unpermute(rows, slots, probs))
    grad_args = (dy, slots, rows.shape[0], rows.dtype, probs, False, None, rows)
    return found + _rows(
        "npu_moe_token_unpermute_grad_v2", case, tiny, moe.GRAD,
        [a["permuted_tokens"], a["unpermuted_tokens_grad"], a["sorted_indices"], a["probs"]], {"padded_mode": False},
        lambda: gt.npu_moe_token_unpermute_grad_v2(*grad_args),
        lambda: ops.npu_moe_token_unpermute_grad_v2(*grad_args), lambda: torch_moe_grad(torch, rows, dy, slots, probs))


def torch_permute(tokens: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert id, stably: row r holds the token of slot ``order[r]``; sorted_indices inverts it."""
    order = torch.argsort(ids.reshape(-1), stable=True)
    slots = torch.empty_like(order)
    slots[order] = torch.arange(order.numel())
    return tokens[order // (ids.shape[1] if ids.dim() == 2 else 1)], slots.to(torch.int32)


def torch_permute_grad(grad: torch.Tensor, slots: torch.Tensor, topk: int) -> torch.Tensor:
    return grad.float()[slots.long()].view(slots.numel() // topk, topk, -1).sum(1).to(grad.dtype)


def _permute_cases(tokens: int, topk: int, hidden: int, dtype: str, tiny: bool) -> list[Measurement]:
    case = f"T={tokens} K={topk} H={hidden} {dtype}"
    forward = PermuteCase(PERMUTE.op_type, tokens, topk, hidden, dtype).arrays()
    x, ids = to_torch(forward["tokens"]), to_torch(forward["indices"])
    grad = PermuteCase(PERMUTE_GRAD.op_type, tokens, topk, hidden, dtype).arrays()
    dy, slots = to_torch(grad["permuted_output_grad"]), to_torch(grad["sorted_indices"])
    ops = torch.ops.geir
    grad_args = (dy, slots, tokens, dy.dtype, topk)
    return (_rows("npu_moe_token_permute", case, tiny, PERMUTE, [forward["tokens"], forward["indices"]],
                  {"num_out_tokens": 0, "padded_mode": False}, lambda: gt.npu_moe_token_permute(x, ids),
                  lambda: ops.npu_moe_token_permute(x, ids), lambda: torch_permute(x, ids))
            + _rows("npu_moe_token_permute_grad_v2", case, tiny, PERMUTE_GRAD,
                    [grad["permuted_output_grad"], grad["sorted_indices"]], {"num_topk": topk, "padded_mode": False},
                    lambda: gt.npu_moe_token_permute_grad_v2(*grad_args),
                    lambda: ops.npu_moe_token_permute_grad_v2(*grad_args),
                    lambda: torch_permute_grad(dy, slots, topk)))


# -- sparse flash attention and its grad ------------------------------------------------------------------------------
def torch_sfa(f: dict[str, Any], scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's math for B=1, N2=1, block 1, sparse_mode 0 (every selected key read): gather, bmm, softmax."""
    q = f["query"] if f["query_rope"] is None else torch.cat([f["query"], f["query_rope"]], -1)
    k = f["key"] if f["key_rope"] is None else torch.cat([f["key"], f["key_rope"]], -1)
    rows = f["sparse_indices"][0, :, 0].long()                                  # (S1, K)
    kg, vg = k.float()[0, :, 0][rows], f["value"].float()[0, :, 0][rows]      # (S1, K, D)
    scores = torch.bmm(q.float()[0], kg.transpose(1, 2)) * scale               # (S1, N1, K)
    row_max = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(-1, keepdim=True)
    out = torch.bmm(weights / row_sum, vg).to(f["query"].dtype)[None]
    return out, row_max, row_sum


def _sfa_cases(spec: SfaCase, tiny: bool) -> list[Measurement]:
    a = spec.arrays()
    t = _tensors(a)
    scale = spec.scale
    case = f"B={spec.B} S1={spec.S1} S2={spec.S2} N1={spec.N1} K={spec.K} D={spec.D} Dr={spec.Dr} {spec.dtype}"
    keywords = dict(query_rope=t["query_rope"], key_rope=t["key_rope"], sparse_block_size=spec.bs,
                    sparse_mode=spec.mode, return_softmax_lse=True)
    args = (t["query"], t["key"], t["value"], t["sparse_indices"], scale)
    ops = torch.ops.geir
    forward_arrays = [a.get(s.name) for s in sparse_attention.FORWARD.inputs]
    forward_attrs = {"scale_value": scale, "sparse_block_size": spec.bs, "layout_query": "BSND", "layout_kv": "BSND",
                     "sparse_mode": spec.mode, "pre_tokens": 2**63 - 1, "next_tokens": 2**63 - 1,
                     "attention_mode": 0, "return_softmax_lse": True}
    rows = _rows("npu_sparse_flash_attention", case, tiny, sparse_attention.FORWARD, forward_arrays, forward_attrs,
                 lambda: gt.npu_sparse_flash_attention(*args, **keywords),
                 lambda: ops.npu_sparse_flash_attention(*args, **keywords), lambda: torch_sfa(t, scale))
    out, row_max, row_sum = gt.npu_sparse_flash_attention(*args, **keywords)
    d_out = torch.ones_like(out)
    grad_args = (*args[:4], d_out, out, row_max, row_sum, scale, spec.bs, t["query_rope"], t["key_rope"], None, None,
                 "BSND", spec.mode)
    named = {**{k: v for k, v in t.items() if v is not None}, "d_out": d_out, "out": out, "softmax_max": row_max,
             "softmax_sum": row_sum}
    grad_arrays = [None if s.name not in named else to_numpy(named[s.name], s.name) for s in sparse_attention.GRAD.inputs]
    grad_attrs = {"scale_value": scale, "sparse_block_size": spec.bs, "layout": "BSND", "sparse_mode": spec.mode}
    return rows + _rows("npu_sparse_flash_attention_grad", case, tiny, sparse_attention.GRAD, grad_arrays, grad_attrs,
                        lambda: gt.npu_sparse_flash_attention_grad(*grad_args),
                        lambda: ops.npu_sparse_flash_attention_grad(*grad_args),
                        lambda: torch_sfa_grad(torch, named, scale))


# -- the in-place rotary and its backward (interleave) ---------------------------------------------------------------
def torch_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int, end: int,
                  grad: bool = False) -> None:
    """Rotate ``x[..., start:end]`` in place, interleaved pairs (mode 1), or apply the rotation's transpose."""
    g, c, s = x[..., start:end].float(), cos.float(), sin.float()
    sign = -1.0 if grad else 1.0
    y = torch.empty_like(g)
    y[..., 0::2] = c[..., 0::2] * g[..., 0::2] - sign * (s[..., 1::2] if grad else s[..., 0::2]) * g[..., 1::2]
    y[..., 1::2] = c[..., 1::2] * g[..., 1::2] + sign * (s[..., 0::2] if grad else s[..., 1::2]) * g[..., 0::2]
    x[..., start:end] = y.to(x.dtype)


def _rotation_tables(spec: RotaryCase, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of one angle per interleaved pair: a rotation, so repeated in-place calls keep x's scale."""
    width = spec.partial_slice[1] - spec.partial_slice[0]
    angle = np.repeat(np.random.default_rng(spec.seed).uniform(0, 2 * np.pi, (1, spec.shape[1], 1, width // 2)), 2, -1)
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def _rotary_cases(spec: RotaryCase, tiny: bool) -> list[Measurement]:
    case = f"{list(spec.shape)} {spec.dtype} slice {list(spec.partial_slice)}"
    start, end = spec.partial_slice
    found = []
    for function, schema, grad in (("inplace_partial_rotary_mul", rotary.FORWARD, False),
                                   ("inplace_partial_rotary_mul_backward", rotary.GRAD, True)):
        x_array = spec.arrays()["x"]    # tables: float32 for the forward (as `geir bench rotary`), x's for the grad
        cos_array, sin_array = _rotation_tables(spec, x_array.dtype if grad else np.dtype(np.float32))
        x, cos, sin = to_torch(x_array), to_torch(cos_array), to_torch(sin_array)
        fn, op = getattr(gt, function), getattr(torch.ops.geir, function)
        keywords = {"rotary_mode": "interleave", "partial_slice": [start, end]}
        found += _rows(function, case, tiny, schema, [x_array, cos_array, sin_array],
                       {"rotary_mode": spec.rotary_mode, "partial_slice": [start, end]},
                       lambda fn=fn, x=x, cos=cos, sin=sin: fn(x, cos, sin, **keywords),
                       lambda op=op, x=x, cos=cos, sin=sin: op(x, cos, sin, **keywords),
                       lambda x=x, cos=cos, sin=sin, grad=grad: torch_rotary_(x, cos, sin, start, end, grad),
                       in_place=True)
    return found


# -- the suite ----------------------------------------------------------------------------------------------------------
TINY = {"moe": MoeCase(4, 2, 8), "permute": (4, 2, 8, "float32"),
        "sfa": SfaCase(B=1, S1=4, S2=8, N1=2, D=8, D2=8, Dr=4, K=4, mode=0, full=True),
        "rotary": RotaryCase((1, 1, 1, 8), (0, 8))}
"""The tiny shape of each family: what a call costs when the kernel has almost nothing to do."""


def torch_measurements(quick: bool) -> list[Measurement]:
    """Every geir.torch function at its family's bench (or quick) shapes and at its tiny shape."""
    size = "quick" if quick else "bench"
    rows: list[Measurement] = []
    for spec in moe.examples.BENCH[size]:
        rows += _unpermute_cases(spec, False)
    rows += _unpermute_cases(TINY["moe"], True)
    for spec in permute_examples.BENCH[size]:
        if spec.op == PERMUTE.op_type:
            rows += _permute_cases(spec.tokens, spec.topk, spec.hidden, spec.dtype, False)
    rows += _permute_cases(*TINY["permute"], True)
    rows += _sfa_cases(sparse_attention.examples.BENCH[size], False) + _sfa_cases(TINY["sfa"], True)
    for spec in rotary.examples.BENCH[size]:
        rows += _rotary_cases(spec, False)
    return rows + _rotary_cases(TINY["rotary"], True)
