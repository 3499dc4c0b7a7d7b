"""What type checkers see as ``geir.torch``: the PyTorch front door, ``tools/torch`` (Python never reads this file).

``import geir.torch`` resolves at run time through ``tools/lazy_torch.py`` (so ``import geir`` never imports torch);
a type checker runs no import hook and finds the module here instead. The names loaded on first use
(``tools/torch/__init__.py``'s ``_LAZY``) are imported from their modules explicitly.
"""

from .tools.torch import *
from .tools.torch import __all__ as __all__
from .tools.torch.compile_backend import CompiledGraph as CompiledGraph
from .tools.torch.compile_backend import GeirBackend as GeirBackend
from .tools.torch.compile_backend import backend as backend
from .tools.torch.onnx_export import export_onnx as export_onnx
from .tools.torch.onnx_export import onnx_translation_table as onnx_translation_table
from .tools.torch.onnx_export import to_graph as to_graph
