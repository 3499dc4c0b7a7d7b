"""The runtime core knows no array library (issue 24, item 3): a test backend of a foreign array type runs on it.

``Boxed`` holds a NumPy array and is not one; ``BoxedBackend`` answers the core's questions about it
(``runtimes._arrays.ArrayBackend``) and a few kernels registered under its name run the NumPy kernels on the
unwrapped data. The interpreter, the feed checks, the output-buffer checks and a data rule then work on Boxed
arrays exactly as on the NumPy runtime, with the same results and the same error texts.
"""

from __future__ import annotations

import ast
import contextlib
import pathlib
import warnings

import numpy as np
import pytest

import geir
from geir.ir._dtypes import DType
from geir.runtimes import _kernels as registry
from geir.runtimes._arrays import Array, ArrayBackend
from geir.runtimes._interpreter import InterpretedExecutable
from geir.runtimes.numpy import KERNELS
from geir.runtimes.numpy.moe import moe_token_unpermute
from geir.runtimes.numpy.rotary import rotary_mul_grad
from helpers import random_feeds
from moe.helpers import MOE, moe_graph
from rotary.helpers import ROPE_GRAD

_DTYPES = {d.numpy: d for d in DType}


class Boxed:
    """A foreign array type: holds an ndarray, is not one (no ``__array__``: NumPy cannot read it by accident)."""

    __slots__ = ("data",)

    def __init__(self, data: np.ndarray) -> None:
        assert type(data) is np.ndarray
        self.data = data

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> str:
        return f"boxed<{self.data.dtype}>"     # only the backend reads it


def _raw(x: object) -> object:
    return x.data if isinstance(x, Boxed) else x


class BoxedBackend:
    name = "boxed-test"
    array_type = Boxed
    kind = "a Boxed array"
    empty_example = "Boxed(np.empty(shape, dtype))"

    def __init__(self) -> None:
        self.host_views: list[tuple[tuple[int, ...], bool]] = []
        self.errstates = 0

    def is_array(self, obj: object) -> bool:
        return isinstance(obj, Boxed)

    def as_array(self, feed: object, where: str) -> Boxed:
        if not isinstance(feed, Boxed):
            raise geir.ExecutionError(f"{where}: expected a Boxed array, got {type(feed).__name__}")
        return feed

    def from_host(self, array: np.ndarray) -> Boxed:
        return Boxed(array)

    def host_view(self, array: Boxed, values: bool = True) -> np.ndarray:
        self.host_views.append((array.shape, values))
        return array.data if values else np.broadcast_to(np.zeros((), array.data.dtype), array.shape)

    def dtype_of(self, array: Boxed) -> DType | None:
        return _DTYPES.get(array.data.dtype)

    def dtype_name(self, array: Boxed) -> str:
        return str(array.data.dtype)

    def may_share_memory(self, a: Boxed, b: object) -> bool:
        return bool(np.may_share_memory(_raw(a), _raw(b)))

    def is_writeable_contiguous(self, array: Boxed) -> bool:
        return bool(array.data.flags.c_contiguous and array.data.flags.writeable)

    def copy(self, array: Boxed) -> Boxed:
        return Boxed(array.data.copy())

    def copy_into(self, buffer: Boxed, array: Boxed) -> None:
        np.copyto(buffer.data, array.data)

    @contextlib.contextmanager
    def kernel_errstate(self):
        self.errstates += 1
        with np.errstate(all="ignore"):
            yield


BOXED = BoxedBackend()
IN_PLACE: list[bool] = []
"""Whether each rotary grad call was handed its input as ``out`` (the run owned that buffer)."""


def _boxed_rotary_grad(dy, cos, sin, *, out=None, **attributes):
    """The NumPy kernel on the unwrapped arrays; ``out`` (a buffer the run owns or the caller's) is written."""
    IN_PLACE.append(out is dy)
    result = rotary_mul_grad(dy.data, cos.data, sin.data, out=None if out is None else out.data, **attributes)
    return out if out is not None and result is out.data else Boxed(result)


def _boxed_moe(tokens, sorted_indices, probs=None, **attributes):
    return Boxed(moe_token_unpermute(tokens.data, sorted_indices.data, _raw(probs), **attributes))


def _kernel_of(numpy_op):
    def run(*args, **attrs):
        return Boxed(np.asarray(numpy_op(*(a.data for a in args))))
    return run


registry.register_kernel(BOXED, "", "Add", _kernel_of(np.add))
registry.register_kernel(BOXED, "", "Mul", _kernel_of(np.multiply))
registry.register_kernel(BOXED, "ai.cann", ROPE_GRAD, _boxed_rotary_grad)
registry.register_kernel(BOXED, "ai.cann", MOE, _boxed_moe)


class BoxedExecutable(InterpretedExecutable):
    runtime_name = "boxed-test"
    backend = BOXED

    def resolve(self, node):
        kernel = registry.kernel_for(self.backend, node.domain, node.op_type)
        return None if kernel is None else (kernel, True)


def _box(feeds: dict[str, np.ndarray]) -> dict[str, Boxed]:
    return {name: Boxed(array) for name, array in feeds.items()}


def _rope_chain() -> geir.Graph:
    """Add -> rotary grad (in place on the Add's buffer, which the run owns) -> Mul by a constant."""
    b = geir.GraphBuilder("chain")
    a = b.input("a", "float32", (1, 8, 2, 16))
    c = b.input("c", "float32", (1, 8, 2, 16))
    cos = b.input("cos", "float32", (1, 8, 1, 16))
    sin = b.input("sin", "float32", (1, 8, 1, 16))
    dx = b.InplacePartialRotaryMulGrad(b.op("Add", a, c), cos, sin, rotary_mode=1, partial_slice=[0, 16], name="rope")
    half = b.constant("half", np.full((1, 8, 2, 16), 0.5, np.float32))
    b.output(b.op("Mul", dx, half), "y")
    b.output(dx, "dx")
    return b.build()


def test_the_interpreter_runs_a_foreign_array_type_as_the_numpy_runtime_does():
    g = _rope_chain()
    feeds = random_feeds(g, seed=7)
    snapshot = {k: v.copy() for k, v in feeds.items()}
    want = geir.run(g, feeds, runtime="numpy")
    executable = BoxedExecutable(g)
    IN_PLACE.clear()
    before = BOXED.errstates
    got = executable.run(_box(feeds))
    assert set(got) == {"y", "dx"} and all(type(v) is Boxed for v in got.values())
    assert all(np.array_equal(got[k].data, want[k]) for k in want)
    assert IN_PLACE == [True]                  # the Add's result was owned, so the grad wrote over it
    assert BOXED.errstates == before + 1
    assert all(np.array_equal(snapshot[k], feeds[k]) for k in feeds)     # feeds never written
    assert not any(np.may_share_memory(got["y"].data, f) for f in feeds.values())


def test_a_fed_output_is_copied_and_kernels_run_without_floating_point_warnings():
    b = geir.GraphBuilder("big")
    x = b.input("x", "float32", (3,))
    b.output(b.op("Mul", x, x), "y")
    b.output(x)                                 # a graph input passed through: a copy, never the feed
    g = b.build()
    x = np.array([1e30, -1e30, 2.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = BoxedExecutable(g).run({"x": Boxed(x)})
    assert np.array_equal(got["y"].data, np.array([np.inf, np.inf, 4.0], np.float32))
    assert type(got["x"]) is Boxed and got["x"].data is not x and np.array_equal(got["x"].data, x)


def test_caller_buffers_are_written_and_returned():
    g = _rope_chain()
    feeds = random_feeds(g, seed=8)
    want = geir.run(g, feeds, runtime="numpy")
    buffers = {name: Boxed(np.zeros_like(array)) for name, array in want.items()}
    got = BoxedExecutable(g).run(_box(feeds), outputs=buffers)
    assert all(got[name] is buffers[name] for name in buffers)
    assert all(np.array_equal(buffers[name].data, want[name]) for name in want)


BAD_BUFFERS = [
    (lambda f: {"y": np.zeros((1, 8, 2, 16), np.float32)}, "output buffer 'y': expected a Boxed array, got ndarray"),
    (lambda f: {"y": Boxed(np.zeros((1, 8, 2, 16), np.float16))},
     "output buffer 'y': expected dtype float32, got float16"),
    (lambda f: {"y": Boxed(np.zeros((1, 8, 2, 32), np.float32)[..., ::2])},
     r"output buffer 'y': expected a writeable C-contiguous array \(Boxed\(np.empty\(shape, dtype\)\) is one\)"),
    (lambda f: {"y": Boxed(f["a"][...])}, "output buffer 'y': shares memory with feed 'a'"),
    (lambda f: {"y": Boxed(f["a"])}, "output buffer 'y': shares memory with feed 'a'"),
    (lambda f: (lambda m: {"y": Boxed(m[0]), "dx": Boxed(m[0])})(np.zeros((2, 1, 8, 2, 16), np.float32)),
     "output buffer 'dx': shares memory with the buffer of output 'y'"),
]


@pytest.mark.parametrize("make, message", BAD_BUFFERS,
                         ids=["not boxed", "dtype", "strided", "view of a feed", "a feed", "aliasing buffers"])
def test_bad_output_buffers_are_refused_through_the_protocol(make, message):
    g = _rope_chain()
    feeds = random_feeds(g, seed=9)
    with pytest.raises(geir.ExecutionError, match=message):
        BoxedExecutable(g).run(_box(feeds), outputs=make(feeds))


def test_a_buffer_over_a_graph_constant_is_refused():
    g = _rope_chain()
    with pytest.raises(geir.ExecutionError, match="output buffer 'y': shares memory with graph constant 'half'"):
        BoxedExecutable(g).run(_box(random_feeds(g)), outputs={"y": Boxed(g.constants["half"])})


def test_feed_checks_say_what_the_numpy_runtime_says():
    g = _rope_chain()
    feeds = random_feeds(g, seed=10)
    executable = BoxedExecutable(g)
    cases = [
        {**feeds, "a": feeds["a"].astype(np.float64)},    # wrong dtype
        {**feeds, "a": feeds["a"][:, :4]},                # wrong dim
        {**feeds, "a": feeds["a"][0]},                    # wrong rank
        {k: v for k, v in feeds.items() if k != "c"},     # missing
        {**feeds, "extra": feeds["a"]},                   # unexpected
    ]
    for bad in cases:
        with pytest.raises(geir.ExecutionError) as numpy_error:
            geir.run(g, bad, runtime="numpy")
        with pytest.raises(geir.ExecutionError) as boxed_error:
            executable.run(_box(bad))
        assert str(boxed_error.value) == str(numpy_error.value)
    with pytest.raises(geir.ExecutionError, match="input 'a': expected a Boxed array, got ndarray"):
        executable.run({**_box(feeds), "a": feeds["a"]})


def test_a_data_rule_reads_host_views_of_the_inputs_whose_values_it_checks():
    g = moe_graph(4, 3, 4, (2, 2), name="moe")
    feeds = random_feeds(g, seed=11)
    feeds["indices"] = np.array([0, 2, 2, 1], np.int32)     # not a permutation: MU-D1
    with pytest.raises(geir.ExecutionError, match="MU-D1") as numpy_error:
        geir.run(g, feeds, runtime="numpy")
    BOXED.host_views.clear()
    with pytest.raises(geir.ExecutionError, match="MU-D1") as boxed_error:
        BoxedExecutable(g).run(_box(feeds))
    assert str(boxed_error.value) == str(numpy_error.value) and "'moe'" in str(boxed_error.value)
    assert sorted(BOXED.host_views) == [((2, 2), False), ((4,), True), ((4, 3), False)]   # values of the indices
    feeds["indices"] = np.array([3, 0, 2, 1], np.int32)
    BOXED.host_views.clear()
    got = BoxedExecutable(g).run(_box(feeds))
    assert np.array_equal(got["y"].data, geir.run(g, feeds, runtime="numpy")["y"])
    assert len(BOXED.host_views) == 3


def test_no_host_views_for_nodes_without_a_data_rule():
    g = _rope_chain()
    BOXED.host_views.clear()
    BoxedExecutable(g).run(_box(random_feeds(g)))
    assert BOXED.host_views == []


def test_kernel_results_are_checked_and_failures_name_the_node(monkeypatch):
    g = _rope_chain()
    feeds = _box(random_feeds(g))
    table = registry.kernel_table(BOXED)
    monkeypatch.setitem(table, ("ai.cann", ROPE_GRAD), lambda dy, cos, sin, **kw: Boxed(dy.data.astype(np.float64)))
    with pytest.raises(geir.ExecutionError, match=r"kernel returned float64\[1, 8, 2, 16\] for output 'dx'"):
        BoxedExecutable(g).run(feeds)

    def broken(*args, **kwargs):
        raise ValueError("boom")
    monkeypatch.setitem(table, ("ai.cann", ROPE_GRAD), broken)
    with pytest.raises(geir.ExecutionError, match="While executing InplacePartialRotaryMulGrad 'rope'.*boom"):
        BoxedExecutable(g).run(feeds)
    monkeypatch.delitem(table, ("ai.cann", ROPE_GRAD))
    with pytest.raises(geir.GraphError, match="runtime 'boxed-test' has no kernel for ai.cann::"
                                              "InplacePartialRotaryMulGrad"):
        BoxedExecutable(g)


def test_the_registry_is_keyed_by_backend_and_refuses_a_second_kernel():
    assert registry.kernel_for(BOXED, "", "Add") is not None
    assert registry.kernel_for("numpy", "", "Add") is None           # numpy runs standard ops on onnx.reference
    assert registry.kernel_for("numpy", "ai.cann", ROPE_GRAD) is rotary_mul_grad
    assert registry.kernel_table("numpy") is KERNELS
    assert registry.kernel_for("no such backend", "ai.cann", ROPE_GRAD) is None
    with pytest.raises(ValueError, match=r"op ai.cann::InplacePartialRotaryMulGrad has two boxed-test kernels"):
        registry.register_kernel(BOXED, "ai.cann", ROPE_GRAD, _boxed_rotary_grad)
    with pytest.raises(ValueError, match=r"op ai.cann::InplacePartialRotaryMulGrad has two numpy kernels"):
        registry.register_kernel("numpy", "ai.cann", ROPE_GRAD, rotary_mul_grad)
    assert registry.kernel_for(BOXED, "ai.cann", ROPE_GRAD) is _boxed_rotary_grad


def test_the_backends_satisfy_the_protocol():
    from geir.runtimes.numpy._arrays import NUMPY

    members = [m for m in vars(ArrayBackend) if not m.startswith("_")] + list(ArrayBackend.__annotations__)
    for backend in (NUMPY, BOXED):
        assert all(hasattr(backend, m) for m in members), [m for m in members if not hasattr(backend, m)]
    assert isinstance(np.zeros(2), Array) and isinstance(Boxed(np.zeros(2)), Array)


CORE = ["_arrays.py", "_checks.py", "_compiled.py", "_feeds.py", "_interpreter.py", "_kernels.py", "_outputs.py",
        "_protocol.py"]


@pytest.mark.parametrize("module", CORE)
def test_the_runtime_core_imports_no_array_library(module):
    path = pathlib.Path(geir.runtimes.__file__).parent / module
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & {"numpy", "ml_dtypes", "torch", "cupy"}
