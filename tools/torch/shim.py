"""A stand-in ``torch_npu`` module for CPU test machines: ``install_npu_shim()`` (explicit, never on import).

Model code written for the NPU (MindSpeed's MoE layers: ``import torch_npu`` at call time, then
``torch_npu.npu_moe_token_permute(tokens, indices)`` ... ``torch_npu.npu_moe_token_unpermute(rows, sorted_indices,
probs)``) then runs unchanged on the CPU: each ``torch_npu.npu_*`` name geir.torch provides resolves to geir.torch's
function (the same ``torch.library`` custom op, with its autograd and fake kernel). Any other ``torch_npu``
attribute is an AttributeError naming the shim, never a silent stand-in.

Only where no real torch_npu exists: installing refuses (RuntimeError) when a ``torch_npu`` other than this shim is
already in ``sys.modules`` or importable. ``torch.ops.npu.<name>`` is not provided (it would need a second
registration of every op in the ``npu`` namespace); model code reaching the ops that way still needs torch_npu.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

from . import moe, sparse_attention

__all__ = ["NPU_FUNCTIONS", "install_npu_shim", "npu_shim", "uninstall_npu_shim"]

NPU_FUNCTIONS = ("npu_moe_token_permute", "npu_moe_token_permute_grad_v2", "npu_moe_token_unpermute",
                 "npu_moe_token_unpermute_grad", "npu_moe_token_unpermute_grad_v2", "npu_sparse_flash_attention",
                 "npu_sparse_flash_attention_grad")
"""The ``torch_npu`` names the shim provides (geir.torch's functions of the same names)."""
_MARK = "__geir_npu_shim__"


class _NpuShim(ModuleType):
    def __getattr__(self, name: str):
        raise AttributeError(f"module 'torch_npu' (geir.torch's CPU shim) has no attribute {name!r}: the shim "
                             f"provides {', '.join(NPU_FUNCTIONS)}")


def _installed() -> ModuleType | None:
    found = sys.modules.get("torch_npu")
    return found if found is not None and getattr(found, _MARK, False) else None


def install_npu_shim() -> ModuleType:
    """Insert the shim as ``sys.modules['torch_npu']`` and return it (the installed one again if called twice).

    RuntimeError if a real torch_npu is already imported or importable: geir never shadows the NPU's own."""
    shim = _installed()
    if shim is not None:
        return shim
    if "torch_npu" in sys.modules:
        raise RuntimeError("geir.torch.install_npu_shim: a torch_npu module is already imported "
                           f"({sys.modules['torch_npu']!r}); the shim only stands in where there is none")
    if importlib.util.find_spec("torch_npu") is not None:
        raise RuntimeError("geir.torch.install_npu_shim: a real torch_npu is installed; import it instead (the shim "
                           "only stands in for it on machines without an NPU stack)")
    shim = _NpuShim("torch_npu", "geir.torch's CPU stand-in for torch_npu: " + ", ".join(NPU_FUNCTIONS))
    setattr(shim, _MARK, True)
    shim.__all__ = list(NPU_FUNCTIONS)
    for name in NPU_FUNCTIONS:
        setattr(shim, name, getattr(sparse_attention if "attention" in name else moe, name))
    sys.modules["torch_npu"] = shim
    return shim


def uninstall_npu_shim() -> bool:
    """Remove the shim from ``sys.modules`` (True if it was installed; a real torch_npu is never touched)."""
    if _installed() is None:
        return False
    del sys.modules["torch_npu"]
    return True


@contextlib.contextmanager
def npu_shim() -> Iterator[ModuleType]:
    """``install_npu_shim()`` for the ``with`` block; removed after it unless it was installed before."""
    already = _installed() is not None
    shim = install_npu_shim()
    try:
        yield shim
    finally:
        if not already:
            uninstall_npu_shim()
