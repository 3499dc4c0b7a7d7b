"""Imported models by content: ``geir.run(path or ModelProto)`` imports and compiles a model once per content.

The key is the SHA-256 of the model's bytes (the file's, or the ModelProto's serialisation), so an edited file
or proto is a new entry and the same content under another name or object is the same one; the graph an entry
holds keeps its executables (``runtimes._compiled``). Users never see the cached graph (run, check, grad and
fuse do not change it), so sharing it cannot leak an edit. At most ``MAX_MODELS`` entries, least recently used
dropped first; ``clear()`` frees them all.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict

from onnx import ModelProto

from ..ir._core import Graph
from .external_data import inline_external_data
from .onnx_import import from_onnx, parse_model, read_model_bytes

__all__ = ["MAX_MODELS", "clear", "imported"]

MAX_MODELS = 8

_models: OrderedDict[str, Graph] = OrderedDict()
_lock = threading.Lock()


def imported(model: ModelProto | str | os.PathLike[str]) -> Graph:
    """The built graph of ``model`` (a ModelProto or an ONNX file's path), imported once per content. A file whose
    initializers live in external data files is imported on every call and never cached (its content is more than
    its bytes), so a cached graph's bytes name no external data."""
    data = model.SerializeToString() if isinstance(model, ModelProto) else read_model_bytes(model)
    key = hashlib.sha256(data).hexdigest()
    with _lock:
        graph = _models.get(key)
        if graph is not None:
            _models.move_to_end(key)
            return graph
    if not isinstance(model, ModelProto):
        path, model = model, parse_model(data, repr(os.fspath(model)))
        if inline_external_data(model, path):
            return from_onnx(model)
    graph = from_onnx(model)   # outside the lock: an import may take long
    with _lock:
        graph = _models.setdefault(key, graph)   # a racing import of the same content: keep the first
        _models.move_to_end(key)
        while len(_models) > MAX_MODELS:
            _models.popitem(last=False)
    return graph


def clear() -> None:
    """Free every cached model (and with it the executables compiled from it)."""
    with _lock:
        _models.clear()
