"""Torch in, torch out (issue 30 item 6): ``geir.torch.run`` gives ``geir.run``'s results bit for bit as torch
tensors of the same dtype (bfloat16 and float8 included) on every runtime, holding the memory the runtime allocated
(no copy) and never a feed's; ``geir.torch.to_torch`` shares a NumPy array's memory where a tensor may, copies it
where not (read-only, negative strides), and names a dtype torch has none of; a tensor off the CPU is refused as
every geir.torch function refuses it."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import geir  # noqa: E402
import geir.torch as gt  # noqa: E402
from geir.tools.torch import interop  # noqa: E402
from geir.tools.torch._bridge import to_numpy  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from .helpers import bits  # noqa: E402

RUNTIMES = geir.runtimes.runtime_names()
DTYPES = ("float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool")
SHAPES = ((2, 3), (), (0, 4))


def _numpy_dtype(name: str) -> np.dtype:
    return geir.as_dtype(name).numpy


def _graph(dtype: str, shape: tuple[int, ...]) -> geir.Graph:
    """``y = x + x`` (``not x`` for bool; a Cast round trip where ONNX Runtime has no Add for the dtype) and ``x``
    itself as an output (a graph input passed through)."""
    b = geir.GraphBuilder(f"twice_{dtype}")
    x = b.input("x", dtype, shape)
    if dtype == "bool":
        y = b.op("Not", x)
    elif dtype in ("bfloat16", "int8", "int16", "uint8"):
        wide = b.op("Cast", x, to=geir.float32.onnx)
        y = b.op("Cast", b.op("Add", wide, wide), to=geir.as_dtype(dtype).onnx)
    else:
        y = b.op("Add", x, x)
    b.output(y, "y")
    b.output(x, "x")
    return b.build()


def _feed(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    values = np.asarray(np.random.default_rng(0).standard_normal(shape) * 20)
    return np.asarray(values > 0) if dtype == "bool" else values.astype(_numpy_dtype(dtype))


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """An independent copy of ``array`` as a tensor (not through the code under test)."""
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_run_gives_geir_runs_results_as_tensors_bit_for_bit_without_a_copy(dtype, shape, runtime, monkeypatch):
    array = _feed(dtype, shape)
    graph = _graph(dtype, shape)
    want = geir.run(graph, {"x": array}, runtime=runtime)
    feed = _as_tensor(array)
    returned: list[dict[str, np.ndarray]] = []

    def spy(*args, **kwargs):
        result = geir.run(*args, **kwargs)
        returned.append(result)
        return result

    monkeypatch.setattr(interop, "_run", spy)
    got = gt.run(graph, {"x": feed}, runtime=runtime)

    assert list(got) == ["y", "x"]
    for name, tensor in got.items():
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu" and not tensor.requires_grad
        assert tensor.dtype == getattr(torch, str(want[name].dtype)), name
        assert tuple(tensor.shape) == want[name].shape
        np.testing.assert_array_equal(bits(tensor), bits(want[name]))
        array_out = returned[0][name]
        if array_out.size:                       # the tensor is the runtime's array, not a copy of it
            assert tensor.data_ptr() == array_out.ctypes.data
            assert tuple(tensor.stride()) == tuple(s // array_out.itemsize for s in array_out.strides)
        assert not _overlap(tensor, feed), f"output '{name}' shares the feed's memory"
    np.testing.assert_array_equal(bits(feed), bits(array))          # the feed is untouched


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_in_place_op_on_a_tensor_feed_writes_a_fresh_tensor_and_leaves_the_feed(runtime):
    b = geir.GraphBuilder("rope")
    x = b.input("x", "bfloat16", (1, 4, 2, 8))
    cos = b.input("cos", "bfloat16", (1, 4, 1, 8))
    sin = b.input("sin", "bfloat16", (1, 4, 1, 8))
    b.output(b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=0, partial_slice=[0, 8]), "y")
    graph = b.build()
    gen = torch.Generator().manual_seed(1)
    feeds = {"x": torch.randn(1, 4, 2, 8, generator=gen).bfloat16(),
             "cos": torch.rand(1, 4, 1, 8, generator=gen).bfloat16(),
             "sin": torch.rand(1, 4, 1, 8, generator=gen).bfloat16()}
    before = feeds["x"].clone()
    got = gt.run(graph, feeds, runtime=runtime)["y"]
    want = geir.run(graph, {k: v.clone() for k, v in feeds.items()}, runtime=runtime)["y"]
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(bits(got), bits(want))
    assert torch.equal(feeds["x"], before) and not _overlap(got, feeds["x"])
    assert not torch.equal(got, before)                # the op did rotate (the test can fail)


def test_a_feed_that_requires_grad_runs_and_the_result_records_no_autograd():
    b = geir.GraphBuilder("twice")
    x = b.input("x", "float32", (3,))
    b.output(b.op("Add", x, x), "y")
    feed = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    got = gt.run(b.build(), {"x": feed})["y"]
    assert not got.requires_grad and got.grad_fn is None
    assert got.tolist() == [2.0, -4.0, 1.0]


def test_run_takes_numpy_feeds_and_an_onnx_model_as_geir_run_does(tmp_path):
    graph = _graph("float16", (2, 3))
    geir.save_onnx(graph, tmp_path / "twice.onnx")
    array = _feed("float16", (2, 3))
    got = gt.run(str(tmp_path / "twice.onnx"), {"x": array}, runtime="onnxruntime")
    np.testing.assert_array_equal(got["y"].numpy(), array + array)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_output_tensors_are_written_and_returned_as_they_are(runtime):
    b = geir.GraphBuilder("scale")
    x = b.input("x", "bfloat16", (2, 4))
    wide = b.op("Cast", x, to=geir.float32.onnx)
    b.output(b.op("Cast", b.op("Add", wide, wide), to=geir.bfloat16.onnx), "y")
    graph = b.build()
    feed = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    buffer = torch.full((2, 4), -1.0, dtype=torch.bfloat16)
    pointer = buffer.data_ptr()
    got = gt.run(graph, {"x": feed}, runtime=runtime, outputs={"y": buffer})
    assert got["y"] is buffer and buffer.data_ptr() == pointer
    assert torch.equal(buffer, feed * 2)

    with pytest.raises(geir.ExecutionError, match="output tensor 'y' requires grad"):
        gt.run(graph, {"x": feed}, outputs={"y": torch.zeros(2, 4, dtype=torch.bfloat16, requires_grad=True)})
    with pytest.raises(geir.ExecutionError, match="output buffer 'y': expected dtype bfloat16, got float32"):
        gt.run(graph, {"x": feed}, runtime=runtime, outputs={"y": torch.zeros(2, 4)})
    negative = torch.zeros(2, 4, dtype=torch.bfloat16)._neg_view()   # torch's lazy negation: the run cannot write it
    with pytest.raises(geir.ExecutionError, match="output tensor 'y' is a conjugate or negative view"):
        gt.run(graph, {"x": feed}, runtime=runtime, outputs={"y": negative})


def test_a_tensor_off_the_cpu_is_refused_as_geir_torch_refuses_it():
    """A FakeTensor on cuda stands in for a CUDA tensor on a machine without one (the device is all that is read)."""
    b = geir.GraphBuilder("twice")
    x = b.input("x", "float32", (3,))
    b.output(b.op("Add", x, x), "y")
    graph = b.build()
    with FakeTensorMode():
        on_gpu = torch.empty(3, device="cuda")
    with pytest.raises(geir.ExecutionError, match=r"feed 'x' is a cuda tensor \(cuda:0\): geir computes on the CPU "
                                                  r"only .*move it with \.cpu\(\)"):
        gt.run(graph, {"x": on_gpu})
    with pytest.raises(geir.ExecutionError, match=r"output tensor 'y' is a cuda tensor"):
        gt.run(graph, {"x": torch.ones(3)}, outputs={"y": on_gpu})
    with pytest.raises(geir.ExecutionError) as op_refusal:         # what the ops' converter says of it
        to_numpy(on_gpu, "x")
    with pytest.raises(geir.ExecutionError) as run_refusal:
        gt.run(graph, {"x": on_gpu})
    assert str(run_refusal.value).split(" is a ")[1] == str(op_refusal.value).split(" is a ")[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_feed_is_refused():   # pragma: no cover - depends on the machine
    b = geir.GraphBuilder("twice")
    x = b.input("x", "float32", (3,))
    b.output(b.op("Add", x, x), "y")
    with pytest.raises(geir.ExecutionError, match="feed 'x' is a cuda tensor"):
        gt.run(b.build(), {"x": torch.ones(3, device="cuda")})


@pytest.mark.parametrize("dtype", (*DTYPES, "uint16", "uint32", "uint64", "complex64", "complex128"))
def test_to_torch_shares_a_writeable_arrays_memory(dtype):
    array = _feed(dtype, (3, 4)) if not dtype.startswith("complex") else np.ones((3, 4), dtype)
    for view in (array, array[:, 1::2], array[1]):               # contiguous, strided, offset
        tensor = gt.to_torch(view)
        assert tensor.data_ptr() == view.ctypes.data
        assert tuple(tensor.stride()) == tuple(s // view.itemsize for s in view.strides)
        raw = tensor.view(getattr(torch, f"int{8 * view.itemsize}")) if view.itemsize <= 8 else tensor
        assert np.shares_memory(raw.numpy(), view)
        same = raw.numpy()                          # the same bits (raw integers; complex128 as itself)
        np.testing.assert_array_equal(same, view.view(same.dtype))


@pytest.mark.parametrize("dtype", sorted(n for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                                      "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)))
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_float8_result_comes_back_as_torchs_float8_bit_for_bit(dtype, runtime):
    values = np.array([[0.5, -1.0, 2.0], [448.0 if "e4m3" in dtype else 4.0, 0.0, 0.25]])
    if dtype == "float8_e8m0fnu":
        values = np.abs(values) + 1
    b = geir.GraphBuilder("constant")
    b.output(b.constant("c", values.astype(getattr(ml_dtypes, dtype))), "c")
    want = geir.run(b.build(), {}, runtime=runtime)["c"]
    got = gt.to_torch(want)
    assert got.dtype == getattr(torch, dtype) and got.data_ptr() == want.ctypes.data
    np.testing.assert_array_equal(got.view(torch.uint8).numpy(), want.view(np.uint8))
    np.testing.assert_array_equal(got.float().numpy(), want.astype(np.float32))    # torch reads the same values


def test_to_torch_copies_what_a_tensor_may_not_share():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    array.flags.writeable = False                  # a constant, say: a tensor over it would be a way to write it
    tensor = gt.to_torch(array)
    assert not np.shares_memory(tensor.numpy(), array)
    tensor[0, 0] = 7
    assert array[0, 0] == 0

    broadcast = np.broadcast_to(np.float32(3), (2, 2))              # read-only, zero strides
    assert gt.to_torch(broadcast).tolist() == [[3.0, 3.0], [3.0, 3.0]]

    flipped = np.arange(4, dtype=ml_dtypes.bfloat16)[::-1]           # torch has no negative strides
    tensor = gt.to_torch(flipped)
    assert tensor.dtype == torch.bfloat16 and tensor.tolist() == [3.0, 2.0, 1.0, 0.0]
    assert not np.shares_memory(tensor.view(torch.int16).numpy(), flipped)

    swapped = np.arange(3, dtype=">f4")                               # another byte order: converted exactly
    assert gt.to_torch(swapped).tolist() == [0.0, 1.0, 2.0]


def test_to_torch_converts_what_geir_run_returns_whole():
    arrays = geir.run(_graph("bfloat16", (2, 3)), {"x": _feed("bfloat16", (2, 3))})
    tensors = gt.to_torch(arrays)
    assert list(tensors) == ["y", "x"] and all(t.dtype == torch.bfloat16 for t in tensors.values())
    as_tuple = gt.to_torch((arrays["y"], arrays["x"]))
    as_list = gt.to_torch([arrays["y"]])
    assert isinstance(as_tuple, tuple) and isinstance(as_list, list)
    assert as_tuple[0].data_ptr() == as_list[0].data_ptr() == arrays["y"].ctypes.data
    converted = gt.to_torch({"absent": None, "seq": [arrays["x"]]})
    assert converted["absent"] is None and converted["seq"][0].data_ptr() == arrays["x"].ctypes.data


def test_a_dtype_torch_has_none_of_is_named():
    b = geir.GraphBuilder("constant")
    b.output(b.constant("c", np.arange(4).astype(ml_dtypes.int4)), "c")
    arrays = geir.run(b.build(), {})
    with pytest.raises(TypeError, match=r"output 'c': torch has no dtype for int4 values \(torch's sub-byte dtypes "
                                        r"are packed"):
        gt.to_torch(arrays)
    with pytest.raises(TypeError, match="array: torch has no dtype for <U1 values"):
        gt.to_torch(np.array(["a"]))
    with pytest.raises(TypeError, match="expected a NumPy array, or a dict, tuple or list of them.*got int"):
        gt.to_torch(3)  # type: ignore[call-overload]
