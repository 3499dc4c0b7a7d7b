"""geir.torch's eager fast path (``tools/torch/_eager.py``): on plain eager calls the public functions run the op's
body without torch's dispatcher, bit for bit what the registered op (``torch.ops.geir.<name>``) gives, with the same
errors, version counter bumps and fresh outputs; every guard (grad, FakeTensorMode, a TorchDispatchMode, a
TorchFunctionMode, a tensor subclass, the profiler, an argument the dispatcher converts, torch.compile) routes the
call to the op instead."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import geir  # noqa: E402
import geir.torch as gt  # noqa: E402
from geir.tools.torch._bridge import to_torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from sparse_attention.helpers import AttentionCase  # noqa: E402
from .helpers import bits  # noqa: E402

T, K, H = 6, 2, 8
FAST = ("npu_moe_token_unpermute", "npu_moe_token_unpermute_grad", "npu_moe_token_unpermute_grad_v2",
        "npu_moe_token_permute", "npu_moe_token_permute_grad_v2", "npu_sparse_flash_attention",
        "sparse_flash_attention", "npu_sparse_flash_attention_grad", "inplace_partial_rotary_mul",
        "inplace_partial_rotary_mul_backward", "partial_rotary_mul", "partial_rotary_mul_backward")


@contextlib.contextmanager
def op_calls(fn: Any) -> Iterator[list[int]]:
    """Count the calls ``fn`` hands to its registered op (its ``_op`` closure cell, swapped for a counter)."""
    cell = dict(zip(fn.__code__.co_freevars, fn.__closure__))["_op"]
    op, calls = cell.cell_contents, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return op(*args, **kwargs)

    cell.cell_contents = counted
    try:
        yield calls
    finally:
        cell.cell_contents = op


def _moe(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    rows, slots = torch.ops.geir.npu_moe_token_permute(x, ids)
    return x, ids, torch.rand(T, K, generator=g).to(dtype), rows, slots, torch.randn(T, H, generator=g).to(dtype)


def _attention(layout="BSND", rope=4, dtype="float16"):
    case = AttentionCase(layout=layout, dtype=dtype, Dr=rope, N1=4, N2=2, bs=2, seed=3)
    t = {k: None if v is None else to_torch(np.ascontiguousarray(v).copy()) for k, v in case.arrays().items()}
    lengths = {k: t[k] for k in ("actual_seq_lengths_query", "actual_seq_lengths_kv")} if layout == "TND" else {}
    args = (t["query"], t["key"], t["value"], t["sparse_indices"], case.scale)
    keywords = dict(query_rope=t["query_rope"], key_rope=t["key_rope"], sparse_block_size=case.bs,
                    layout_query=layout, layout_kv=layout, sparse_mode=case.mode, return_softmax_lse=True, **lengths)
    return case, t, args, keywords


@functools.cache
def _calls() -> list[tuple[str, tuple, dict]]:
    """(function, args, kwargs) covering each function's forms: dtypes, optional inputs, dropped rows, layouts."""
    x, ids, probs, rows, slots, dy = _moe()
    bx, bids, bprobs, brows, bslots, bdy = _moe(torch.bfloat16, 1)
    calls = [("npu_moe_token_unpermute", (rows, slots, probs), {}),
             ("npu_moe_token_unpermute", (brows, bslots, bprobs.float()), {"restore_shape": (T, H)}),
             ("npu_moe_token_unpermute", (rows, torch.randperm(T * K).int()), {}),     # no probs: topK 1
             ("npu_moe_token_unpermute_grad", (rows, dy, slots, probs), {}),
             ("npu_moe_token_unpermute_grad", (brows, torch.randn(T * K, H).bfloat16(), bslots), {}),
             ("npu_moe_token_unpermute_grad_v2", (dy, slots, T * K, torch.float32, probs, False, None, rows), {}),
             ("npu_moe_token_unpermute_grad_v2", (dy, slots, T * K - 3, torch.float32, probs, False, None,
                                                  rows[:T * K - 3]), {}),
             ("npu_moe_token_unpermute_grad_v2", (torch.randn(T * K, H), slots, T * K, torch.float32), {}),
             ("npu_moe_token_permute", (x, ids), {}),
             ("npu_moe_token_permute", (bx, bids), {"num_out_tokens": -3}),
             ("npu_moe_token_permute", (x, ids[:, 0].long()), {}),
             ("npu_moe_token_permute_grad_v2", (torch.randn(T * K, H), slots, T, torch.float32, K), {}),
             ("npu_moe_token_permute_grad_v2", (torch.randn(T * K, 2, 4), slots, T, torch.float32, K), {})]
    for layout, rope in (("BSND", 4), ("BSND", 0), ("TND", 4)):
        case, t, args, keywords = _attention(layout, rope)
        calls.append(("npu_sparse_flash_attention", args, keywords))
        calls.append(("npu_sparse_flash_attention", args, {**keywords, "return_softmax_lse": False}))
        out, row_max, row_sum = torch.ops.geir.npu_sparse_flash_attention(*args, **keywords)
        lengths = (keywords.get("actual_seq_lengths_query"), keywords.get("actual_seq_lengths_kv"))
        calls.append(("npu_sparse_flash_attention_grad", (*args[:4], torch.randn_like(out), out, row_max, row_sum,
                                                          case.scale, case.bs, t["query_rope"], t["key_rope"],
                                                          *lengths, layout, case.mode), {}))
    _, _, args, keywords = _attention()
    calls.append(("sparse_flash_attention", (*args, None, None, None, keywords["query_rope"], keywords["key_rope"],
                                             2), {}))
    angle = torch.rand(1, 5, 1, 16) * 6
    for dtype in (torch.float32, torch.bfloat16):
        q, cos, sin = torch.randn(2, 5, 3, 24).to(dtype), angle.cos().to(dtype), angle.sin().to(dtype)
        for name in ("inplace_partial_rotary_mul", "inplace_partial_rotary_mul_backward", "partial_rotary_mul",
                     "partial_rotary_mul_backward"):
            calls.append((name, (q, cos, sin), {"rotary_mode": "half", "partial_slice": (4, 20)}))
    calls.append(("inplace_partial_rotary_mul", (q, cos, sin), {"partial_slice": [4, 20]}))
    return calls


def _cloned(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _outputs(result: Any) -> list[torch.Tensor]:
    return [] if result is None else list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("index", range(len(_calls())))
def test_the_fast_path_is_taken_and_gives_the_ops_bits_versions_and_fresh_outputs(index):
    name, args, kwargs = _calls()[index]
    fn = getattr(gt, name)
    fast_args, op_args = [_cloned(a) for a in args], [_cloned(a) for a in args]
    with op_calls(fn) as calls:
        fast = fn(*fast_args, **kwargs)
    assert calls == []                                                   # the dispatcher was skipped
    slow = getattr(torch.ops.geir, name)(*op_args, **kwargs)
    assert type(fast) is type(slow)
    for got, want in zip(_outputs(fast), _outputs(slow), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and not got.requires_grad
        assert np.array_equal(bits(got), bits(want))
    for a, b in zip(fast_args, op_args):                                  # in-place results, and nothing else moved
        if isinstance(a, torch.Tensor):
            assert np.array_equal(bits(a), bits(b)) and a._version == b._version
    inputs = {a.untyped_storage().data_ptr() for a in fast_args if isinstance(a, torch.Tensor) and a.numel()}
    assert not inputs & {o.untyped_storage().data_ptr() for o in _outputs(fast) if o.numel()}   # the op's check


def test_the_fast_functions_keep_the_ops_signatures_and_defaults():
    for name in FAST:
        fn, schema = getattr(gt, name), getattr(torch.ops.geir, name).default._schema
        assert fn.op is getattr(torch.ops.geir, name) and fn.__module__.startswith("geir.tools.torch.")
        defaults = {**dict(zip(fn.__code__.co_varnames[fn.__code__.co_argcount - len(fn.__defaults__ or ()):],
                               fn.__defaults__ or ())), **(fn.__kwdefaults__ or {})}
        for arg in schema.arguments:
            assert (arg.name in defaults) == arg.has_default_value(), (name, arg.name)
            if arg.has_default_value():
                want, got = arg.default_value, defaults[arg.name]
                assert (list(got) if isinstance(got, tuple) else got) == want, (name, arg.name)
            assert (arg.name in (fn.__kwdefaults__ or {})) == arg.kwarg_only, (name, arg.name)


def test_gradients_go_through_the_op_and_no_grad_through_the_fast_path():
    _, _, probs, rows, slots, dy = _moe()
    leaf = rows.clone().requires_grad_()
    with op_calls(gt.npu_moe_token_unpermute) as calls:
        out = gt.npu_moe_token_unpermute(leaf, slots, probs)
    assert calls == [1] and out.grad_fn is not None
    out.backward(dy)
    assert torch.equal(leaf.grad, gt.npu_moe_token_unpermute_grad_v2(dy, slots, T * K, torch.float32, probs,
                                                                      permuted_tokens=rows)[0])
    with torch.no_grad(), op_calls(gt.npu_moe_token_unpermute) as calls:
        same = gt.npu_moe_token_unpermute(leaf, slots, probs)
    assert calls == [] and same.grad_fn is None and torch.equal(same, out.detach())
    with torch.inference_mode(), op_calls(gt.npu_moe_token_unpermute) as calls:
        inferred = gt.npu_moe_token_unpermute(rows, slots, probs)
    assert calls == [] and inferred.is_inference() and torch.equal(inferred, same)
    with torch.inference_mode():
        assert torch.ops.geir.npu_moe_token_unpermute(rows, slots, probs).is_inference()


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Sub(torch.Tensor):
    pass


def test_modes_fake_tensors_subclasses_and_the_profiler_take_the_op():
    _, _, probs, rows, slots, _ = _moe()
    fn = gt.npu_moe_token_unpermute
    want = torch.ops.geir.npu_moe_token_unpermute(rows, slots, probs)
    with op_calls(fn) as calls:
        with FakeTensorMode() as mode:
            fake = fn(mode.from_tensor(rows), mode.from_tensor(slots), mode.from_tensor(probs))
        assert isinstance(fake, FakeTensor) and fake.shape == want.shape and len(calls) == 1
        with _Seen() as seen:
            assert torch.equal(fn(rows, slots, probs), want)
        assert "geir.npu_moe_token_unpermute.default" in seen.ops and len(calls) == 2
        with _Functions():
            assert torch.equal(fn(rows, slots, probs), want)
        assert len(calls) == 3
        assert torch.equal(fn(rows.as_subclass(_Sub), slots, probs), want) and len(calls) == 4
        with torch.profiler.profile() as profile:
            fn(rows, slots, probs)
        assert len(calls) == 5 and any("geir::npu_moe_token_unpermute" in e.name for e in profile.events())
        meta = fn(rows.to("meta"), slots.to("meta"), probs.to("meta"))   # the op's fake kernel, as before
        assert meta.device.type == "meta" and len(calls) == 6


def test_arguments_the_dispatcher_converts_take_the_op_or_the_same_conversion():
    _, _, _, rows, slots, _ = _moe()
    fn = gt.npu_moe_token_permute_grad_v2
    grad = torch.randn(T * K, H)
    want = torch.ops.geir.npu_moe_token_permute_grad_v2(grad, slots, T, torch.float32, K)
    with op_calls(fn) as calls:
        assert torch.equal(fn(grad, slots, T, torch.float32, np.int64(K)), want) and calls == [1]   # NumPy int
        assert torch.equal(fn(grad, slots, T, torch.float32, K, 0), want) and calls == [1, 1]       # int for bool
        assert torch.equal(fn(grad, slots, T, torch.float32, K, False), want) and calls == [1, 1]
    case, _, args, keywords = _attention()
    integral = (*args[:4], 1)                                              # an int scale: float(), as torch does
    with op_calls(gt.npu_sparse_flash_attention) as calls:
        got = gt.npu_sparse_flash_attention(*integral, **keywords)
    assert calls == [] and all(np.array_equal(bits(a), bits(b)) for a, b in zip(
        got, torch.ops.geir.npu_sparse_flash_attention(*integral, **keywords)))
    x = torch.randn(2, 5, 3, 24)
    with op_calls(gt.inplace_partial_rotary_mul) as calls:                 # one int for int[2]: torch repeats it
        gt.inplace_partial_rotary_mul(x, torch.ones(1, 5, 1, 8), torch.zeros(1, 5, 1, 8), partial_slice=8)
    assert calls == [1]


def test_errors_are_the_ops_errors():
    _, _, probs, rows, slots, _ = _moe()
    repeated = slots.clone()
    repeated[1] = repeated[0]
    for args, error, rule in (((rows, repeated, probs), geir.ExecutionError, "MU-D1"),
                              ((rows, slots[:-1], probs), geir.GraphError, "MU-S2")):
        with pytest.raises(error) as fast:
            gt.npu_moe_token_unpermute(*args)
        with pytest.raises(error) as slow:
            torch.ops.geir.npu_moe_token_unpermute(*args)
        assert fast.value.rule == slow.value.rule == rule
        if error is geir.GraphError:    # the message, and the caller's line (each call's own)
            assert fast.value.message == slow.value.message
            assert fast.value.location.filename == slow.value.location.filename == __file__
        else:
            assert str(fast.value) == str(slow.value)
    with pytest.raises(geir.GraphError, match="RP-S4"):
        gt.inplace_partial_rotary_mul(torch.randn(1, 2, 1, 8), torch.ones(1, 2, 1, 8), torch.zeros(1, 2, 1, 8),
                                      rotary_mode="spiral")


def test_the_in_place_fast_path_bumps_the_version_autograd_checks():
    w = torch.randn(2, 4, 3, 16, requires_grad=True)
    x = torch.randn(2, 4, 3, 16)
    y = w * x                                             # saves x for w's gradient
    gt.inplace_partial_rotary_mul(x, torch.rand(1, 4, 1, 16).cos(), torch.rand(1, 4, 1, 16).sin())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.models   # torch.compile
def test_compile_fullgraph_records_the_op_itself():
    x, ids, probs, _, _, _ = _moe()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(tokens, indices, weights):
        permuted, slots = gt.npu_moe_token_permute(tokens, indices)
        return gt.npu_moe_token_unpermute(permuted * 2, slots, weights)

    with op_calls(gt.npu_moe_token_unpermute) as calls:
        got = torch.compile(step, fullgraph=True, backend=capture)(x, ids, probs)
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {"geir.npu_moe_token_permute.default", "geir.npu_moe_token_unpermute.default"} <= targets
    assert calls and torch.equal(got, step(x, ids, probs))


PUBLIC = ["npu_moe_token_permute", "npu_moe_token_permute_grad_v2", "npu_moe_token_unpermute",
          "npu_moe_token_unpermute_grad", "npu_moe_token_unpermute_grad_v2", "npu_sparse_flash_attention",
          "sparse_flash_attention", "npu_sparse_flash_attention_grad", "inplace_partial_rotary_mul",
          "inplace_partial_rotary_mul_backward", "partial_rotary_mul", "partial_rotary_mul_backward"]
_FILLER = {"int": 1, "SymInt": 1, "float": 0.5, "bool": False, "str": "BSND", "ScalarType": torch.float32}


@pytest.mark.parametrize("name", PUBLIC)
def test_none_for_a_required_tensor_is_an_error_naming_the_function_and_the_input(name):
    """torch's dispatcher lets None through for a required Tensor: each function says so before calling the op,
    instead of an AttributeError from inside its body."""
    fn = getattr(gt, name)
    schema = fn.op.default._schema
    required = [a.name for a in schema.arguments if str(a.real_type) == "Tensor"]
    assert required
    for missing in required:
        positional, keywords = [], {}
        for a in schema.arguments:
            if a.has_default_value():
                continue
            kind = str(a.real_type)
            value = None if a.name == missing else torch.ones(2) if kind == "Tensor" else _FILLER[kind]
            (keywords.__setitem__(a.name, value) if a.kwarg_only else positional.append(value))
        with pytest.raises(geir.GraphError, match=f"^{name}: input '{missing}': expected a tensor, got None") as e:
            fn(*positional, **keywords)
        assert e.value.location is not None and e.value.location.filename == __file__     # the caller's line
