"""``geir.torch``: torch_npu's calls for geir's ops, computed on the CPU by geir's NumPy kernels.

Each function is a ``torch.library`` custom op in the ``geir`` namespace (``torch.ops.geir.<name>``) with a fake
kernel (FakeTensor tracing, ``torch.compile(fullgraph=True)``) and, where op-plugin has one, autograd. Imported only
on request (``import geir.torch``): ``import geir`` never imports torch.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (the optional extra: pip install geir[models])
except ImportError as exc:   # pragma: no cover - depends on the environment
    raise ImportError("geir.torch needs PyTorch (pip install torch); geir itself does not") from exc

from .moe import (npu_moe_token_permute, npu_moe_token_permute_grad_v2, npu_moe_token_unpermute,
                  npu_moe_token_unpermute_grad, npu_moe_token_unpermute_grad_v2)
from .rotary import (ROTARY_MODES, inplace_partial_rotary_mul, inplace_partial_rotary_mul_backward,
                     partial_rotary_mul, partial_rotary_mul_backward)
from .sparse_attention import npu_sparse_flash_attention, npu_sparse_flash_attention_grad, sparse_flash_attention
from .shim import install_npu_shim, npu_shim, uninstall_npu_shim

__all__ = ["ROTARY_MODES", "inplace_partial_rotary_mul", "inplace_partial_rotary_mul_backward", "install_npu_shim",
           "npu_moe_token_permute", "npu_moe_token_permute_grad_v2", "npu_moe_token_unpermute",
           "npu_moe_token_unpermute_grad", "npu_moe_token_unpermute_grad_v2", "npu_shim",
           "npu_sparse_flash_attention", "npu_sparse_flash_attention_grad", "partial_rotary_mul",
           "partial_rotary_mul_backward", "sparse_flash_attention", "uninstall_npu_shim"]
