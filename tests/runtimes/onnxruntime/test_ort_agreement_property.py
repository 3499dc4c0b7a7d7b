"""geir's ONNX Runtime runtime against plain ONNX Runtime on random graphs (issue 23: a runtime that binds, copies or
reuses buffers must give what the exported model gives): inputs of rank 0 to 3 (broadcasting), float32 and float16,
symbolic or static dims, elementwise ops, Unsqueeze, ReduceSum to any rank, Cast, Shape, constants, and outputs that
are inner values, passed-through inputs and constants. Plain ONNX Runtime gets the same session options (the same
native kernels), so every output must match bit for bit, with and without caller buffers. A derandomised set by
default, a longer run with -m slow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geir
from geir.runtimes import get_runtime
from geir.runtimes.onnxruntime._session import session_options

DTYPES = ("float32", "float16")
T = TypeVar("T")


@dataclass
class Drawn:
    """A random graph under construction: its values, the base shape all shapes broadcast with, two sets of feeds.
    Choices come from a generator seeded by hypothesis (uniform: derandomised draws of hypothesis's own favour the
    simplest graphs)."""

    rng: np.random.Generator
    base: tuple[int, ...]
    symbolic: bool
    b: geir.GraphBuilder = field(default_factory=lambda: geir.GraphBuilder("random_outputs"))
    values: list[geir.Value] = field(default_factory=list)
    feeds: list[dict[str, np.ndarray]] = field(default_factory=lambda: [{}, {}])
    marked: set[int] = field(default_factory=set)     # ids of the values marked as outputs
    count: int = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def shape(self) -> tuple[int, ...]:
        """A trailing part of the base shape with some dims 1: it broadcasts with every other one."""
        rank = int(self.rng.integers(0, len(self.base) + 1))
        return tuple(d if self.rng.random() < 0.7 else 1 for d in self.base[len(self.base) - rank:])

    def input(self) -> geir.Value:
        shape, dtype = self.shape(), self.choice(DTYPES)
        dims = [f"d{k + len(self.base) - len(shape)}" if self.symbolic and d > 1 else d for k, d in enumerate(shape)]
        value = self.b.input(self.name("in"), dtype, dims)
        for feeds in self.feeds:
            feeds[value.name] = self.rng.uniform(-2, 2, shape).astype(dtype)
        self.values.append(value)
        return value

    def constant(self) -> geir.Value:
        shape, dtype = self.shape(), self.choice(DTYPES)
        value = self.b.constant(self.name("c"), self.rng.uniform(-2, 2, shape).astype(dtype))
        self.values.append(value)
        return value

    def choice(self, options: Sequence[T]) -> T:
        return options[int(self.rng.integers(0, len(options)))]

    def pick(self, dtype: str | None = None) -> geir.Value:
        """A value (of ``dtype``): the newest more often than not, so graphs grow deep as well as wide."""
        choices = [v for v in self.values if dtype is None or str(v.type.dtype) == dtype]
        return choices[-1] if self.rng.random() < 0.5 else self.choice(choices)

    def step(self) -> None:
        a = self.pick()
        kind = self.choice(["Add", "Mul", "Neg", "Unsqueeze", "ReduceSum", "Cast", "Shape", "input", "constant"])
        rank = len(a.type.shape)
        if kind == "input":
            self.input()
        elif kind == "constant":
            self.constant()
        elif kind in ("Add", "Mul"):
            other = self.pick(str(a.type.dtype))
            self.values.append(self.b.op(kind, a, other))
        elif kind == "Neg":
            self.values.append(self.b.op("Neg", a))
        elif kind == "Unsqueeze" and rank < 4:
            self.values.append(self.b.op("Unsqueeze", a, self.b.constant(self.name("axes"), np.array([0], np.int64))))
        elif kind == "ReduceSum":
            keep = self.choice([0, 1])
            if rank and self.rng.random() < 0.5:      # the leading axis only: still a trailing part of the base
                axes = self.b.constant(self.name("axes"), np.array([0], np.int64))
                self.values.append(self.b.op("ReduceSum", a, axes, keepdims=keep))
            else:                                      # every axis: 0-d or all ones
                self.values.append(self.b.op("ReduceSum", a, keepdims=keep))
        elif kind == "Cast":
            to = self.choice(DTYPES)
            self.values.append(self.b.op("Cast", a, to=geir.as_dtype(to).onnx))
        elif kind == "Shape":
            self.output(self.b.op("Shape", a))     # int64: an output, not read further

    def output(self, value: geir.Value) -> None:
        if id(value) not in self.marked:
            self.marked.add(id(value))
            self.b.output(value, None if value.producer is None else self.name("out"))


@st.composite
def random_graph(draw: st.DrawFn) -> tuple[geir.Graph, list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    base = tuple(int(d) for d in rng.integers(1, 4, int(rng.integers(0, 4))))
    g = Drawn(rng, base, bool(rng.random() < 0.5))
    g.input()
    if rng.random() < 0.4:
        g.constant()
    for _ in range(int(rng.integers(1, 7))):
        g.step()
    unread = [v for v in g.values if not v.uses and v.producer is not None]
    extra = [g.choice(g.values) for _ in range(int(rng.integers(0, 4)))]   # inputs, constants, inner values
    for value in unread + extra + ([] if g.marked or unread or extra else [g.values[0]]):
        g.output(value)
    return g.b.build(), g.feeds


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert list(got) == list(want), what
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, (
            f"{what}: {name}: {got[name].dtype}{list(got[name].shape)}, plain {array.dtype}{list(array.shape)}")
        bits = np.dtype(f"u{array.dtype.itemsize}")
        assert np.array_equal(got[name].view(bits), array.view(bits)), f"{what}: {name} values"


def _check(graph: geir.Graph, feeds: list[dict[str, np.ndarray]]) -> None:
    session = ort.InferenceSession(geir.to_onnx(graph).SerializeToString(), session_options(),
                                   providers=["CPUExecutionProvider"])
    names = [v.name for v in graph.outputs]
    want = [dict(zip(names, session.run(names, f))) for f in feeds]
    executable = get_runtime("onnxruntime").compile(graph)
    first = executable.run(feeds[0])
    kept = {k: v.copy() for k, v in first.items()}
    _same(first, want[0], "run 1")
    _same(executable.run(feeds[1]), want[1], "run 2")
    _same(first, kept, "run 1 after run 2")
    buffers = {name: np.full(a.shape, 3, a.dtype) for name, a in want[1].items() if len(names) < 2 or name != names[0]}
    got = executable.run(feeds[1], outputs=buffers)
    assert all(got[name] is buffer for name, buffer in buffers.items())
    _same(got, want[1], "run with buffers")


SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@settings(max_examples=40, **SETTINGS)
@given(random_graph())
def test_random_graphs_agree_with_plain_onnxruntime(case):
    _check(*case)


@pytest.mark.slow
@settings(max_examples=600, **SETTINGS)
@given(random_graph())
def test_random_graphs_agree_with_plain_onnxruntime_long(case):
    _check(*case)
