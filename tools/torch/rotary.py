"""CANN's torch extension rotary calls as ``geir::`` custom ops (InplacePartialRotaryMul and its grad).

``inplace_partial_rotary_mul(Tensor(a!) x, Tensor r1, Tensor r2, *, str rotary_mode="interleave",
int[2] partial_slice=[0, 0]) -> ()`` and ``inplace_partial_rotary_mul_backward(Tensor(a!) grad_output, ...)``
rotate their first tensor in place (r1 = cos, r2 = sin; vllm-ascend calls them as
``torch.ops._C_ascend.inplace_partial_rotary_mul(x, cos, sin, rotary_mode="interleave", partial_slice=[s, e])``).
The mode strings are the schema's ``rotary_mode`` 0..3; any other string is the RP-S4 GraphError.

torch.library refuses autograd on an op that mutates its input ("Cannot register autograd formula for
non-functional operator"), so the differentiable form is the functional pair ``partial_rotary_mul`` (a copy of x,
rotated) and ``partial_rotary_mul_backward``, wired as the in-place op's backward: dx = the rotary grad of dy.
cos and sin get no gradient: the grad op computes dx only.

The in-place ops refuse what torch's own in-place ops refuse or record, instead of giving a silently wrong result: a
tensor that requires grad while grad mode is on, or carries a forward-AD tangent (autograd cannot record the
rotation: their Autograd kernel raises, on every path, ``torch.ops.geir.*`` included), a written tensor whose
elements may share memory, one whose memory range overlaps cos's or sin's, and an inference tensor outside
inference mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.autograd.forward_ad as _forward_ad

from ...ir._errors import ExecutionError, GraphError
from ...schemas import rotary as schemas
from ._bridge import call, missing_tensor, to_numpy

__all__ = ["ROTARY_MODES", "inplace_partial_rotary_mul", "inplace_partial_rotary_mul_backward", "partial_rotary_mul",
           "partial_rotary_mul_backward"]

Tensor = torch.Tensor
ROTARY_MODES = {name: mode for mode, name in schemas.ROTARY_MODES.items()}
"""The extension's mode strings -> the op's ``rotary_mode``: half 0, interleave 1, quarter 2, interleave-half 3."""
_KEYWORDS = '*, str rotary_mode="interleave", int[2] partial_slice=[0, 0]'


def rotary_attributes(op: str, rotary_mode: str, partial_slice: Sequence[int]) -> dict[str, Any]:
    """The op's attributes for the extension's mode string (RP-S4 GraphError for an unknown one)."""
    mode = ROTARY_MODES.get(rotary_mode)
    if mode is None:
        raise GraphError(f"[RP-S4] {op}: attribute 'rotary_mode': expected one of "
                         f"{', '.join(repr(m) for m in ROTARY_MODES)}, got {rotary_mode!r}", rule="RP-S4")
    return {"rotary_mode": mode, "partial_slice": list(partial_slice)}


def _may_overlap(x: Tensor) -> bool:
    """Whether two elements of ``x`` may share memory: torch says they do, or (a layout torch does not decide) the
    stride of some dim, taken by increasing stride, is not greater than the span of the dims of smaller stride.
    Every view made by slicing, stepping or permuting a non-overlapping tensor passes that test, so only a
    hand-made ``as_strided`` layout, overlapping or not, is refused, never rotated into elements that alias."""
    # torch's own in-place ops' check (private API): 0 no overlap, 1 overlap, 2 too hard to tell
    found = torch._debug_has_internal_overlap(x)
    if found != 2 or x.numel() == 0:
        return found == 1
    span = 0
    for stride, size in sorted((st, n) for st, n in zip(x.stride(), x.shape) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _check_in_place_target(op: str, name: str, x: Tensor) -> None:
    """ExecutionError for a tensor the in-place ops may not rotate, as torch's own in-place ops refuse them: one whose
    elements may share memory (an expanded or overlapping view: each write would land on several elements), an
    inference tensor outside inference mode. (A tensor autograd records is refused by ``_refuse_recorded_writes``:
    the op's body runs with grad mode off and cannot tell.)"""
    if x is None:
        raise missing_tensor(name, op)
    if _may_overlap(x):
        raise ExecutionError(f"{op}: '{name}': more than one of its elements refers to the same memory (an expanded "
                             "or overlapping view): rotate a .clone() of it", node=op)
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise ExecutionError(f"{op}: '{name}' is an inference tensor: torch allows updating it in place only inside "
                             "torch.inference_mode()", node=op)


def _rotate(schema: Any, op: str, x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str,
            partial_slice: Sequence[int]) -> None:
    arrays = [to_numpy(x, schema.inputs[0].name), to_numpy(r1, "r1"), to_numpy(r2, "r2")]
    for table, name in ((arrays[1], "r1"), (arrays[2], "r2")):
        if np.may_share_memory(arrays[0], table):    # by bounds: the kernel reads the tables while it writes x
            raise ExecutionError(f"{op}: '{schema.inputs[0].name}' may share memory with '{name}' (their memory "
                                 f"ranges overlap): the rotation could read what it has already written; pass a "
                                 f".clone() of '{name}'", node=op)
    call(schema, arrays, rotary_attributes(op, rotary_mode, partial_slice), out=arrays[0])


@torch.library.custom_op("geir::inplace_partial_rotary_mul", mutates_args=("x",),
                         schema=f"(Tensor(a!) x, Tensor r1, Tensor r2, {_KEYWORDS}) -> ()")
def inplace_partial_rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, *, rotary_mode: str = "interleave",
                               partial_slice: Sequence[int] = (0, 0)) -> None:
    """Rotate ``x[..., start:end]`` in place (InplacePartialRotaryMul)."""
    _check_in_place_target("inplace_partial_rotary_mul", "x", x)
    _rotate(schemas.FORWARD, "inplace_partial_rotary_mul", x, r1, r2, rotary_mode, partial_slice)


@inplace_partial_rotary_mul.register_fake
def _(x: Tensor, r1: Tensor, r2: Tensor, *, rotary_mode: str = "interleave",
      partial_slice: Sequence[int] = (0, 0)) -> None:
    return None


@torch.library.custom_op("geir::inplace_partial_rotary_mul_backward", mutates_args=("grad_output",),
                         schema=f"(Tensor(a!) grad_output, Tensor r1, Tensor r2, {_KEYWORDS}) -> ()")
def inplace_partial_rotary_mul_backward(grad_output: Tensor, r1: Tensor, r2: Tensor, *,
                                        rotary_mode: str = "interleave",
                                        partial_slice: Sequence[int] = (0, 0)) -> None:
    """Replace ``grad_output`` by the gradient w.r.t. x, in place (InplacePartialRotaryMulGrad)."""
    _check_in_place_target("inplace_partial_rotary_mul_backward", "grad_output", grad_output)
    _rotate(schemas.GRAD, "inplace_partial_rotary_mul_backward", grad_output, r1, r2, rotary_mode, partial_slice)


@inplace_partial_rotary_mul_backward.register_fake
def _(grad_output: Tensor, r1: Tensor, r2: Tensor, *, rotary_mode: str = "interleave",
      partial_slice: Sequence[int] = (0, 0)) -> None:
    return None


@torch.library.custom_op("geir::partial_rotary_mul", mutates_args=(),
                         schema=f"(Tensor x, Tensor r1, Tensor r2, {_KEYWORDS}) -> Tensor")
def partial_rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, *, rotary_mode: str = "interleave",
                       partial_slice: Sequence[int] = (0, 0)) -> Tensor:
    """``inplace_partial_rotary_mul`` on a copy of x (x unchanged), differentiable w.r.t. x."""
    out = x.clone(memory_format=torch.contiguous_format)
    _rotate(schemas.FORWARD, "partial_rotary_mul", out, r1, r2, rotary_mode, partial_slice)
    return out


@torch.library.custom_op("geir::partial_rotary_mul_backward", mutates_args=(),
                         schema=f"(Tensor grad_output, Tensor r1, Tensor r2, {_KEYWORDS}) -> Tensor")
def partial_rotary_mul_backward(grad_output: Tensor, r1: Tensor, r2: Tensor, *, rotary_mode: str = "interleave",
                                partial_slice: Sequence[int] = (0, 0)) -> Tensor:
    """``inplace_partial_rotary_mul_backward`` on a copy of grad_output."""
    out = grad_output.clone(memory_format=torch.contiguous_format)
    _rotate(schemas.GRAD, "partial_rotary_mul_backward", out, r1, r2, rotary_mode, partial_slice)
    return out


def _like_first(x: Tensor, r1: Tensor, r2: Tensor, *, rotary_mode: str = "interleave",
                partial_slice: Sequence[int] = (0, 0)) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


partial_rotary_mul.register_fake(_like_first)
partial_rotary_mul_backward.register_fake(_like_first)


def _setup(ctx: Any, inputs: tuple[Any, ...], keyword_only_inputs: dict[str, Any], output: Tensor) -> None:
    _, r1, r2 = inputs
    ctx.keywords = keyword_only_inputs
    ctx.save_for_backward(r1, r2)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
    r1, r2 = ctx.saved_tensors
    return torch.ops.geir.partial_rotary_mul_backward(grad, r1, r2, **ctx.keywords), None, None


partial_rotary_mul.register_autograd(_backward, setup_context=_setup)

_AUTOGRAD = torch.library.Library("geir", "IMPL")
"""The in-place ops' Autograd kernels (kept alive with the module: a Library unregisters them when collected)."""


def _refuse_recorded_writes(name: str, instead: str) -> None:
    """Replace the Autograd kernel ``torch.library.custom_op`` gives the in-place op ``name`` (which runs its body
    with grad mode off and records nothing: autograd would silently miss the rotation, even of a leaf, and give
    cos and sin no gradient) by one that raises an ExecutionError when grad mode is on and one of its tensors
    requires grad, or when forward-mode AD gives one a tangent, and otherwise calls the op below autograd, as
    custom_op's does."""
    op = getattr(torch.ops.geir, name).default
    arguments = [a.name for a in op._schema.arguments if str(a.real_type) == "Tensor"]   # leading: x (or dy), r1, r2

    def autograd_kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        tensors = [(a, t) for a, t in zip(arguments, args) if isinstance(t, Tensor)]
        recorded = [f"'{a}' requires grad" for a, t in tensors if t.requires_grad] if torch.is_grad_enabled() else []
        escape = ", or call it under torch.no_grad()"
        if not recorded and _forward_ad._current_level >= 0:
            recorded = [f"'{a}' carries a forward-AD tangent" for a, t in tensors
                        if _forward_ad.unpack_dual(t).tangent is not None]
            escape = ""
        if recorded:
            raise ExecutionError(f"{name}: {recorded[0]}: autograd cannot record this in-place op (the gradient "
                                 f"would silently miss it); use geir.torch.{instead} (the differentiable form)"
                                 f"{escape}", node=name)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)
    _AUTOGRAD.impl(name, autograd_kernel, "Autograd", with_keyset=True)


_refuse_recorded_writes("inplace_partial_rotary_mul", "partial_rotary_mul")
_refuse_recorded_writes("inplace_partial_rotary_mul_backward", "partial_rotary_mul_backward")


# -- the public names: each op's body straight from plain eager calls, the op itself otherwise (``_eager``) ----------
from ._eager import eager_first, registered_body  # noqa: E402

inplace_partial_rotary_mul = eager_first("inplace_partial_rotary_mul", registered_body(inplace_partial_rotary_mul),
                                         __name__)
inplace_partial_rotary_mul_backward = eager_first("inplace_partial_rotary_mul_backward",
                                                  registered_body(inplace_partial_rotary_mul_backward), __name__)
partial_rotary_mul = eager_first("partial_rotary_mul", registered_body(partial_rotary_mul), __name__)
partial_rotary_mul_backward = eager_first("partial_rotary_mul_backward", registered_body(partial_rotary_mul_backward),
                                          __name__)
