"""Shared by the geir.torch tests: tensors <-> NumPy for geir.run, one-node graphs run through it, and the execution
modes the training steps run under."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

import geir

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """The raw bits, so NaN and -0 compare exactly."""
    a = as_numpy(t) if isinstance(t, torch.Tensor) else t
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def run_op(op_type: str, inputs: dict[str, torch.Tensor | None], **attributes: Any) -> tuple[np.ndarray, ...]:
    """Every output of ``op_type`` on ``inputs`` (GE IR names, None for absent ones) through ``geir.run``."""
    b = geir.GraphBuilder(op_type)
    values = {k: None if v is None else b.input(k, str(as_numpy(v).dtype), tuple(v.shape)) for k, v in inputs.items()}
    result = getattr(b, op_type)(**values, **attributes)
    results = result if isinstance(result, tuple) else (result,)
    names = []
    for i, value in enumerate(results):
        if value is not None:
            b.output(value, f"out{i}")
            names.append(f"out{i}")
    outs = geir.run(b.build(), {k: as_numpy(v) for k, v in inputs.items() if v is not None})
    return tuple(outs[n] for n in names)


# -- execution modes of the training-step tests: add a mode here (its name, its wrapper in `compiled`) -------------

MODES = ("eager", "inductor", "geir")
"""How a training step runs: eager PyTorch, ``torch.compile(fullgraph=True)`` with the default backend, or
``torch.compile`` with geir's backend (``geir.torch.backend``: each graph exported, fused, checked and run by geir)."""
COMPILED_MODES = frozenset(MODES) - {"eager"}
"""The modes that compile (tens of seconds each on two cores): the slow, models-extra runs only."""


def compiled(fn: Any, mode: str) -> Any:
    """``fn`` (a module or a function) as ``mode`` runs it; a compiled mode fails on any graph break."""
    if mode == "eager":
        return fn
    if mode in COMPILED_MODES:
        torch._dynamo.reset()   # each test compiles afresh (a shared step function would hit the recompile limit)
    if mode == "inductor":
        return torch.compile(fn, fullgraph=True)
    if mode == "geir":   # static shapes: a data-dependent size (the MoE's per-expert counts) breaks the graph there
        import geir.torch
        return torch.compile(fn, backend=geir.torch.backend(), dynamic=False)
    raise ValueError(f"unknown execution mode {mode!r}: expected one of {', '.join(MODES)}")


def mode_params() -> list[Any]:
    """``MODES`` as pytest parameters, the compiling ones marked slow and models."""
    compiling = [pytest.mark.slow, pytest.mark.models,
                 # torch 2.13's own: inductor's first import builds torch.utils.mkldnn's TorchScript modules, and
                 # dynamo instantiates a torch.autograd.Function it traces
                 pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
                 pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be "
                                            "instantiated:DeprecationWarning"),
                 # dynamo's own, when it resumes after a graph break (geir mode breaks at the MoE's counts)
                 pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")]
    return [pytest.param(m, marks=compiling if m in COMPILED_MODES else [], id=m) for m in MODES]
