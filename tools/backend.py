"""``geir.backend``: ONNX's backend interface (``onnx.backend.base.Backend``) over geir.

Tools written for that interface, ONNX's own backend test suite first, run models through geir: the model is
imported (``geir.from_onnx``, every rule checked) and compiled for a runtime, which is the device string
("numpy", "onnxruntime"; ONNX's generic "CPU" means the default, ``runtime=``) or the ``runtime`` option.
``Backend`` is geir on the NumPy runtime; ``backend_for(runtime)`` gives the same interface on another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import ModelProto
from onnx.backend.base import Backend as OnnxBackend
from onnx.backend.base import BackendRep, Device, DeviceType, namedtupledict

from ..ir._core import Graph
from ..ir._errors import GraphError
from ..runtimes import get_runtime, runtime_names
from .onnx_import import from_onnx

__all__ = ["Backend", "GeirRep", "backend_for", "prepare", "run_model", "supports_device"]


class GeirRep(BackendRep):
    """A model imported and compiled for one runtime; ``run`` takes the inputs that are not initializers, in the
    model's order (or by name), and returns the outputs in the model's order, by name too."""

    def __init__(self, graph: Graph, runtime: str) -> None:
        self.graph = graph
        self.runtime = runtime
        self.executable = get_runtime(runtime).compile(graph)
        self.input_names = [v.name for v in graph.inputs if v.name not in graph.defaults]
        self.output_names = [v.name for v in graph.outputs]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, Mapping):
            feeds = dict(inputs)
        else:
            values = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(values) > len(self.input_names):
                raise GraphError(f"geir.backend: {len(values)} inputs given, the model '{self.graph.name}' takes "
                                 f"{len(self.input_names)} ({', '.join(self.input_names)})")
            feeds = dict(zip(self.input_names, values))
        results = self.executable.run(feeds)
        return namedtupledict("Outputs", self.output_names)(*[results[name] for name in self.output_names])


def _known(runtime: str) -> str:
    if runtime not in runtime_names():
        raise GraphError(f"geir.backend: runtime {runtime!r}: expected one of {', '.join(runtime_names())}")
    return runtime


def _is_cpu(device: str) -> bool:
    try:
        return Device(device).type == DeviceType.CPU
    except Exception:   # onnx raises on a device string it cannot parse
        return False


def _runtime(device: str, default: str, runtime: str | None) -> str:
    if runtime is not None:
        return _known(runtime)
    if device.lower() in runtime_names():
        return device.lower()
    if _is_cpu(device):
        return default
    raise GraphError(f"geir.backend: device {device!r}: expected CPU or a runtime ({', '.join(runtime_names())})")


class Backend(OnnxBackend):
    """geir as an ONNX backend, on the NumPy runtime unless the device or ``runtime=`` names another."""

    runtime = "numpy"

    @classmethod
    def prepare(cls, model: ModelProto, device: str = "CPU", **kwargs: Any) -> GeirRep:
        runtime = _runtime(device, cls.runtime, kwargs.pop("runtime", None))
        return GeirRep(from_onnx(model), runtime)

    @classmethod
    def run_model(cls, model: ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.lower() in runtime_names() or _is_cpu(device)


def backend_for(runtime: str) -> type[Backend]:
    """The backend whose generic "CPU" device is ``runtime``."""
    return type(f"{runtime.title()}Backend", (Backend,), {"runtime": _known(runtime)})


prepare = Backend.prepare
run_model = Backend.run_model
supports_device = Backend.supports_device
"""The module-level interface ONNX backends also offer (``onnxruntime.backend`` does)."""
