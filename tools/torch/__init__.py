"""``geir.torch``: torch_npu's calls for geir's ops, computed on the CPU by geir's NumPy kernels.

Each function is a ``torch.library`` custom op in the ``geir`` namespace (``torch.ops.geir.<name>``) with a fake
kernel (FakeTensor tracing, ``torch.compile(fullgraph=True)``) and, where op-plugin has one, autograd. The names here
are those ops' signatures as plain functions (``fn.op`` is the op): a plain eager call (CPU tensors, no gradient to
record, no mode, transform or tracer) runs the op's body without torch's dispatcher, which would only add its cost;
every other call goes to the op (``_eager``). Imported only on request (``import geir.torch``): ``import geir`` never
imports torch.

``onnx_translation_table()`` / ``export_onnx()`` export a model calling them to ONNX with ``ai.cann`` nodes, and
``backend()`` is a ``torch.compile`` backend running the model as a fused, target-checked geir graph. ``run()`` is
``geir.run`` with torch tensors in and out, and ``to_torch()`` turns ``geir.run``'s NumPy results into tensors.
"""

from __future__ import annotations

import importlib
from typing import Any

try:
    import torch as _torch  # noqa: F401  (the optional extra: pip install geir[models])
except ImportError as exc:   # pragma: no cover - depends on the environment
    raise ImportError("geir.torch needs PyTorch (pip install torch); geir itself does not") from exc

from .interop import run, to_torch
from .moe import (npu_moe_token_permute, npu_moe_token_permute_grad_v2, npu_moe_token_unpermute,
                  npu_moe_token_unpermute_grad, npu_moe_token_unpermute_grad_v2)
from .rotary import (ROTARY_MODES, inplace_partial_rotary_mul, inplace_partial_rotary_mul_backward,
                     partial_rotary_mul, partial_rotary_mul_backward)
from .sparse_attention import npu_sparse_flash_attention, npu_sparse_flash_attention_grad, sparse_flash_attention
from .shim import install_npu_shim, npu_shim, uninstall_npu_shim

_LAZY = {"export_onnx": "onnx_export", "onnx_translation_table": "onnx_export", "to_graph": "onnx_export",
         "backend": "compile_backend", "GeirBackend": "compile_backend", "CompiledGraph": "compile_backend"}
"""Names loaded on first use: they need onnxscript (torch's ONNX exporter), which the ops themselves do not."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'geir.torch' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        if exc.name != "onnxscript":
            raise
        raise ImportError(f"geir.torch.{name} needs onnxscript, the library torch's ONNX exporter writes with "
                          "(pip install onnxscript, or pip install geir[models])") from exc
    return getattr(loaded, name)


__all__ = ["CompiledGraph", "GeirBackend", "ROTARY_MODES", "backend", "export_onnx", "inplace_partial_rotary_mul",
           "inplace_partial_rotary_mul_backward", "install_npu_shim", "npu_moe_token_permute",
           "npu_moe_token_permute_grad_v2", "npu_moe_token_unpermute", "npu_moe_token_unpermute_grad",
           "npu_moe_token_unpermute_grad_v2", "npu_shim", "npu_sparse_flash_attention",
           "npu_sparse_flash_attention_grad", "onnx_translation_table", "partial_rotary_mul",
           "partial_rotary_mul_backward", "run", "sparse_flash_attention", "to_graph", "to_torch",
           "uninstall_npu_shim"]
