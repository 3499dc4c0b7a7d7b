"""The three paths a model takes through geir, and the engines alone, as ONNX backends for ONNX's backend test
suite (``onnx.backend.test.BackendTest``): geir on the NumPy runtime, geir on the ONNX Runtime runtime, geir's
export run by plain ONNX Runtime (no geir library loaded); onnx.reference and plain ONNX Runtime on the original
file."""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import onnx.backend.test
import onnxruntime as ort
from onnx import ModelProto
from onnx.backend.base import Backend, BackendRep, namedtupledict
from onnx.reference import ReferenceEvaluator

import geir
from geir.tools.backend import backend_for

PATHS = ("numpy", "onnxruntime", "export")
"""geir on each runtime, and geir's export run by plain ONNX Runtime."""


class _SessionRep(BackendRep):
    def __init__(self, run: Any, model: ModelProto) -> None:
        initializers = {t.name for t in model.graph.initializer}
        self._run = run
        self.inputs = [i.name for i in model.graph.input if i.name not in initializers]   # what the suite feeds
        self.outputs = [o.name for o in model.graph.output]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        values = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
        results = self._run(dict(zip(self.inputs, values)))
        return namedtupledict("Outputs", self.outputs)(*results)


def _ort_rep(model: ModelProto) -> _SessionRep:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return _SessionRep(lambda feeds: session.run(None, feeds), model)   # None: every output, in the model's order


class _CpuBackend(Backend):
    """A backend of the CPU device only (the suite's CUDA tests are left out)."""

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


class ExportBackend(_CpuBackend):
    """geir imports the model and exports it again; plain ONNX Runtime runs the export."""

    @classmethod
    def prepare(cls, model: ModelProto, device: str = "CPU", **kwargs: Any) -> BackendRep:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _ort_rep(geir.to_onnx(geir.from_onnx(model)))


class OrtBackend(_CpuBackend):
    """Plain ONNX Runtime on the original model: the engine alone."""

    @classmethod
    def prepare(cls, model: ModelProto, device: str = "CPU", **kwargs: Any) -> BackendRep:
        return _ort_rep(model)


class ReferenceBackend(_CpuBackend):
    """onnx.reference on the original model: the engine alone."""

    @classmethod
    def prepare(cls, model: ModelProto, device: str = "CPU", **kwargs: Any) -> BackendRep:
        evaluator = ReferenceEvaluator(model)
        return _SessionRep(lambda feeds: evaluator.run(None, feeds), model)


BACKENDS: dict[str, type[Backend]] = {"numpy": backend_for("numpy"), "onnxruntime": backend_for("onnxruntime"),
                                      "export": ExportBackend}
ENGINES: dict[str, type[Backend]] = {"numpy": ReferenceBackend, "onnxruntime": OrtBackend, "export": OrtBackend}


def backend_test(backend: type[Backend], module: str, exclude: set[str] = frozenset(),
                 only: set[str] | None = None) -> onnx.backend.test.BackendTest:
    """ONNX's backend tests on the CPU device for ``backend``, without the names in ``exclude`` (or with only those
    in ``only``)."""
    with warnings.catch_warnings():   # generating onnx's node cases casts out of range on purpose
        warnings.simplefilter("ignore")
        test = onnx.backend.test.BackendTest(backend, module)
    test.exclude(r"_cuda$")
    if only is not None:
        test.include("^(" + "|".join(map(re.escape, sorted(only))) + ")$" if only else "^$")
    for name in exclude:
        test.exclude(f"^{re.escape(name)}$")
    return test
