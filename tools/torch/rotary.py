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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...ir._errors import ExecutionError, GraphError
from ...schemas import rotary as schemas
from ._bridge import call, to_numpy

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
    """Whether two elements of ``x`` may share memory: torch says they do, or (a layout torch does not decide) its
    dims by decreasing stride are not each longer than the span of the ones below. That test passes for every view
    made by slicing, stepping or permuting a tensor, so only a hand-made ``as_strided`` layout, overlapping or not,
    is refused, never rotated into elements that alias."""
    found = torch._debug_has_internal_overlap(x)     # 0: no overlap, 1: overlap, 2: too hard to tell
    if found != 2 or x.numel() == 0:
        return found == 1
    span = 0
    for stride, size in sorted((st, n) for st, n in zip(x.stride(), x.shape) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def check_in_place_target(op: str, name: str, x: Tensor) -> None:
    """ExecutionError for a tensor the in-place ops may not rotate, as torch's own in-place ops refuse them: one whose
    elements may share memory (an expanded or overlapping view: each write would land on several elements), an
    inference tensor outside inference mode. (A tensor autograd records is refused by the public functions,
    ``_eager``: the op's body runs with grad mode off and cannot tell.)"""
    if _may_overlap(x):
        raise ExecutionError(f"{op}: '{name}': more than one of its elements refers to the same memory (an expanded "
                             "or overlapping view): rotate a .clone() of it", node=op)
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise ExecutionError(f"{op}: '{name}' is an inference tensor: torch allows updating it in place only inside "
                             "torch.inference_mode()", node=op)


def _rotate(schema: Any, op: str, x: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str,
            partial_slice: Sequence[int]) -> None:
    arrays = [to_numpy(x, schema.inputs[0].name), to_numpy(r1, "r1"), to_numpy(r2, "r2")]
    call(schema, arrays, rotary_attributes(op, rotary_mode, partial_slice), out=arrays[0])


@torch.library.custom_op("geir::inplace_partial_rotary_mul", mutates_args=("x",),
                         schema=f"(Tensor(a!) x, Tensor r1, Tensor r2, {_KEYWORDS}) -> ()")
def inplace_partial_rotary_mul(x: Tensor, r1: Tensor, r2: Tensor, *, rotary_mode: str = "interleave",
                               partial_slice: Sequence[int] = (0, 0)) -> None:
    """Rotate ``x[..., start:end]`` in place (InplacePartialRotaryMul)."""
    check_in_place_target("inplace_partial_rotary_mul", "x", x)
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
    check_in_place_target("inplace_partial_rotary_mul_backward", "grad_output", grad_output)
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


# -- the public names: each op's body straight from plain eager calls, the op itself otherwise (``_eager``) ----------
from ._eager import eager_first, registered_body  # noqa: E402

inplace_partial_rotary_mul = eager_first("inplace_partial_rotary_mul", registered_body(inplace_partial_rotary_mul),
                                         __name__, "use geir.torch.partial_rotary_mul (the differentiable form)")
inplace_partial_rotary_mul_backward = eager_first(
    "inplace_partial_rotary_mul_backward", registered_body(inplace_partial_rotary_mul_backward), __name__,
    "use geir.torch.partial_rotary_mul_backward (the differentiable form)")
partial_rotary_mul = eager_first("partial_rotary_mul", registered_body(partial_rotary_mul), __name__)
partial_rotary_mul_backward = eager_first("partial_rotary_mul_backward", registered_body(partial_rotary_mul_backward),
                                          __name__)
