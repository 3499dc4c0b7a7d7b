"""Initializers a model keeps in external data files beside it (PyTorch's dynamo exporter writes them so by
default), read into the model as untrusted input: each location must name a regular file inside the model's
folder (no absolute path, no ``..``, no link out of it), its offset and length must lie in that file and match
the tensor's size, and all of them together are at most ``MAX_EXTERNAL_BYTES``."""

from __future__ import annotations

import math
import os

from onnx import ModelProto, TensorProto, helper

from ..ir._errors import GraphError
from ..ir._files import FileRefused, read_regular_file
from ..ir._subgraphs import subgraphs_of

__all__ = ["MAX_EXTERNAL_BYTES", "inline_external_data"]

MAX_EXTERNAL_BYTES = 1 << 35
"""Most bytes of external data ``load_onnx`` reads for one model (32 GiB)."""


def _tensors(model: ModelProto) -> list[TensorProto]:
    """The graph's initializers and those of every subgraph."""
    found: list[TensorProto] = []
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        found += list(graph.initializer)
        for node in graph.node:
            for attribute in node.attribute:
                graphs += subgraphs_of(attribute)
    return found


def inline_external_data(model: ModelProto, path: str | os.PathLike[str]) -> bool:
    """Read every external initializer of ``model`` (loaded from the file ``path``) from the data files beside it
    into the model; whether it had any. GraphError naming the tensor and the file for anything wrong."""
    external = [t for t in _tensors(model) if t.data_location == TensorProto.EXTERNAL]
    root, what = os.path.realpath(os.path.dirname(os.path.abspath(path))), repr(os.fspath(path))
    files: dict[str, bytes] = {}
    budget = MAX_EXTERNAL_BYTES
    for tensor in external:
        where = f"{what}: initializer '{tensor.name}'"
        entries = {e.key: e.value for e in tensor.external_data}
        location = entries.get("location", "")
        if not location or os.path.isabs(location) or ".." in location.replace("\\", "/").split("/"):
            raise GraphError(f"{where}: external data location {location!r}: expected a file name relative to the "
                             f"model's folder")
        data_path = os.path.realpath(os.path.join(root, location))
        if os.path.commonpath([root, data_path]) != root:
            raise GraphError(f"{where}: external data location {location!r} leads out of the model's folder")
        if location not in files:
            try:
                files[location] = read_regular_file(data_path, budget, follow_links=False)
            except FileNotFoundError:
                raise GraphError(f"{where}: its external data file {location!r} is missing beside the model") from None
            except FileRefused as exc:
                raise GraphError(f"{where}: its external data file {location!r} {exc}") from None
            budget -= len(files[location])
        data = files[location]
        try:
            offset = int(entries.get("offset", "0"))
            length = int(entries["length"]) if "length" in entries else len(data) - offset
        except ValueError:
            raise GraphError(f"{where}: external data offset/length {entries.get('offset')!r}/"
                             f"{entries.get('length')!r}: expected integers") from None
        if tensor.data_type == TensorProto.STRING:
            raise GraphError(f"{where}: string tensors cannot be stored as external data")
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        size = math.prod(int(d) for d in tensor.dims) * itemsize
        if offset < 0 or length != size or offset + length > len(data):
            raise GraphError(f"{where}: external data bytes [{offset}, {offset + length}) of {location!r} "
                             f"({len(data)} bytes): expected {size} bytes (dims {list(tensor.dims)}) inside the file")
        tensor.raw_data = data[offset:offset + length]
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT
    return bool(external)
