"""Shared by the geir.torch tests: tensors <-> NumPy for geir.run, and one-node graphs run through it."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
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
