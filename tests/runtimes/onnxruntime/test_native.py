"""The native custom-op library: ABI, precedence over function bodies, bit parity, errors, fallback."""

from __future__ import annotations

import ctypes
import itertools

import ml_dtypes
import numpy as np
import pytest

import geir
from geir.runtimes.onnxruntime import native_library, native_status
from helpers import random_feeds
from moe.helpers import moe_grad_graph, moe_graph
from native_helpers import requires_compiler, run_isolated
from oracles.moe import unpermute_grad_reference
from oracles.numerics import assert_matches_reference, assert_within_ulps_of_scale, bits_equal, bits_equal_or_both_nan
from rotary.helpers import ROPE, ROPE_GRAD, empty_grad_slices_expected, rotary_graph
from sparse_attention.helpers import SFA, SFA_GRAD

pytestmark = requires_compiler

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FWD_COMBOS = [("float16", "float16"), ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"),
              ("bfloat16", "float32")]
GRAD_COMBOS = [(d, c) for d in DTYPES for c in DTYPES]


def _calls() -> int:
    counter = ctypes.CDLL(native_library()).geir_native_calls
    counter.restype = ctypes.c_long
    return counter()


def test_library_is_built_loaded_and_proven():
    path = native_library()
    assert path is not None and path.endswith(".so"), native_status()
    assert native_status() == f"native kernels: {path}"


def test_abi_entries_work_on_the_installed_runtime():
    """CreateStatus/GetErrorMessage/ReleaseStatus round-trip a message; GetBuildInfoString names the build."""
    lib = ctypes.CDLL(native_library())
    buffer = ctypes.create_string_buffer(512)
    assert lib.geir_probe_abi(buffer, 512) == 1
    assert buffer.value.startswith(b"ORT Build Info")


@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("op, dtype, cos_dtype", [(ROPE, d, c) for d, c in FWD_COMBOS]
                         + [(ROPE_GRAD, d, c) for d, c in GRAD_COMBOS])
def test_rotary_native_is_bit_identical_for_every_broadcast_pattern(op, mode, dtype, cos_dtype):
    shape, pslice = (2, 3, 4, 21), (5, 13)
    for keep in itertools.product((False, True), repeat=3):
        cos_shape = tuple(d if k else 1 for d, k in zip(shape[:3], keep)) + (8,)
        g = rotary_graph(op, shape, cos_shape, dtype, cos_dtype, rotary_mode=mode, partial_slice=list(pslice))
        feeds = random_feeds(g, seed=sum(keep) + mode)
        before = _calls()
        theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
        assert _calls() > before                       # the native kernel ran, not the function body
        assert bits_equal(theirs, geir.run(g, feeds)["y"]), keep


@empty_grad_slices_expected
@pytest.mark.parametrize("pslice", [(0, 0), (7, 71), (0, 128), (124, 128)])
def test_rotary_native_slices(pslice):
    for op in (ROPE, ROPE_GRAD):
        length = pslice[1] - pslice[0]
        g = rotary_graph(op, (1, 3, 2, 128), (1, 3, 1, length or 4), "bfloat16", rotary_mode=1, partial_slice=list(pslice))
        feeds = random_feeds(g, seed=1)
        assert bits_equal(geir.run(g, feeds, runtime="onnxruntime")["y"], geir.run(g, feeds)["y"])


@pytest.mark.parametrize("tt, tp", [(t, p) for t in DTYPES for p in DTYPES])
def test_moe_native_parity(tt, tp):
    rng = np.random.default_rng(0)
    s = rng.permutation(12).astype(np.int32)
    probs = rng.uniform(-1, 1, (4, 3)).astype(DTYPES[tp])
    probs[1, 2] = 0
    feeds = {"tokens": rng.standard_normal((10, 5)).astype(DTYPES[tt]), "indices": s, "probs": probs}
    g = moe_graph(10, 5, 12, (4, 3), tt, tp)          # two dropped slots (rows 10, 11)
    before = _calls()
    ours, theirs = geir.run(g, feeds)["y"], geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert _calls() > before and bits_equal(theirs, ours)
    g = moe_grad_graph((12, 5), (4, 5), 12, (4, 3), tt, tp)
    feeds = {"tokens": rng.standard_normal((12, 5)).astype(DTYPES[tt]), "dy": rng.standard_normal((4, 5)).astype(DTYPES[tt]),
             "indices": s, "probs": probs}
    ours, theirs = geir.run(g, feeds), geir.run(g, feeds, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"])
    assert_within_ulps_of_scale(theirs["pg"], ours["pg"].astype(np.float64), DTYPES[tp], ulps=2)


def _awkward_values(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Normals with NaNs of both signs and several payloads (quiet and signalling), infinities, signed zeros,
    subnormals and values near the dtype's maximum (which overflow when weighted by |w| > 1)."""
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    bits = x.view(np.uint16 if x.itemsize == 2 else np.uint32).reshape(-1)
    info = ml_dtypes.finfo(dtype)
    specials = np.array([np.inf, -np.inf, 0.0, -0.0, info.max, -info.max, info.smallest_subnormal], dtype)
    picks = rng.choice(bits.size, 4 * len(specials) + 8, replace=False)
    x.reshape(-1)[picks[:4 * len(specials)]] = np.repeat(specials, 4)
    payloads = {2: [0x7fc1, 0xffc0, 0x7f81, 0xff90], 4: [0x7fc00001, 0xffc00000, 0x7f800001, 0xff900000]}[x.itemsize]
    if x.dtype == np.float16:
        payloads = [0x7e01, 0xfe00, 0x7c01, 0xfc90]
    bits[picks[-8:]] = np.repeat(np.array(payloads, bits.dtype), 2)
    return x


@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("op", [ROPE, ROPE_GRAD])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rotary_native_is_bit_identical_with_awkward_values(op, dtype, mode):
    """NaN payloads, infinities, overflow, signed zeros and subnormals in x, cos and sin: the same bits as the
    NumPy kernel, NaN for NaN (a bfloat16 NaN rounds to sign | 0x7fc0 on both; which of two NaN operands a
    product returns IEEE leaves open). A slice of 64 puts every mode's pairs in whole vectors, so the 16-bit
    rows take the kernel's in-register path."""
    rng = np.random.default_rng(3)
    g = rotary_graph(op, (2, 5, 3, 80), (1, 5, 1, 64), dtype, rotary_mode=mode, partial_slice=[8, 72])
    feeds = {v.name: _awkward_values(rng, v.shape, DTYPES[dtype]) for v in g.inputs}
    before = _calls()
    theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert _calls() > before and bits_equal_or_both_nan(theirs, geir.run(g, feeds)["y"])


@pytest.mark.parametrize("hidden", [16, 32, 48, 61, 1000])
@pytest.mark.parametrize("tt, tp", [("float32", "float32"), ("float16", "float32"), ("bfloat16", "bfloat16"),
                                    ("bfloat16", "float32"), ("float16", "float16")])
def test_moe_native_vector_rows_match_the_numpy_kernel(tt, tp, hidden):
    """Rows of whole vectors, and tails, through the vector paths: the forward and permuted_tokens_grad are
    bit-identical to the NumPy kernel with awkward values (NaN payloads, infinities, overflowing products, signed
    zeros, subnormals); probs_grad agrees within float32 rounding where both are finite."""
    rng = np.random.default_rng(hidden)
    tokens_n, topk, rows = 6, 3, 20            # slots 18 and 19 unused by the forward: dropped rows 18, 19
    s = rng.permutation(tokens_n * topk).astype(np.int32)
    probs = rng.uniform(-2, 2, (tokens_n, topk)).astype(DTYPES[tp])
    probs[1, 2] = 0
    feeds = {"tokens": _awkward_values(rng, (rows, hidden), DTYPES[tt]), "indices": s, "probs": probs}
    g = moe_graph(rows, hidden, tokens_n * topk, (tokens_n, topk), tt, tp)
    before = _calls()
    theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert _calls() > before and bits_equal(theirs, geir.run(g, feeds)["y"])
    g = moe_grad_graph((tokens_n * topk, hidden), (tokens_n, hidden), tokens_n * topk, (tokens_n, topk), tt, tp)
    grad_feeds = {"tokens": feeds["tokens"][:tokens_n * topk], "dy": _awkward_values(rng, (tokens_n, hidden), DTYPES[tt]),
                  "indices": s, "probs": probs}
    ours, theirs = geir.run(g, grad_feeds), geir.run(g, grad_feeds, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"])
    finite = {**grad_feeds, "tokens": rng.standard_normal((tokens_n * topk, hidden)).astype(DTYPES[tt]),
              "dy": rng.standard_normal((tokens_n, hidden)).astype(DTYPES[tt])}
    ours, theirs = geir.run(g, finite), geir.run(g, finite, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"])
    *_, pg64, magnitude = unpermute_grad_reference(finite["tokens"], finite["dy"], s, probs)
    bound = (hidden / 32 + 7) * 2.0 ** -24     # float32 sums of hidden / 32 terms per lane, then a tree of 5 levels
    for got in (ours["pg"], theirs["pg"]):
        assert_matches_reference(got, pg64, magnitude, "probs_grad", compute_rel=bound, f32_rel=bound)


@pytest.mark.parametrize("tt", list(DTYPES))
def test_moe_native_grad_does_not_depend_on_where_the_outputs_lie(tt):
    """Caller buffers at every offset (streamed stores need 16-byte alignment, so some rows are streamed and some
    not): the same bits as runtime-allocated outputs, probs_grad included."""
    rng = np.random.default_rng(7)
    tokens_n, topk, hidden = 5, 2, 72
    g = moe_grad_graph((tokens_n * topk, hidden), (tokens_n, hidden), tokens_n * topk, (tokens_n, topk), tt)
    feeds = {"tokens": rng.standard_normal((tokens_n * topk, hidden)).astype(DTYPES[tt]),
             "dy": rng.standard_normal((tokens_n, hidden)).astype(DTYPES[tt]),
             "indices": rng.permutation(tokens_n * topk).astype(np.int32),
             "probs": rng.uniform(-1, 1, (tokens_n, topk)).astype(DTYPES[tt])}
    executable = geir.runtimes.get_runtime("onnxruntime").compile(g)
    want = executable.run(feeds)
    size = np.dtype(DTYPES[tt]).itemsize
    for offset in range(0, 32, size):
        raw = np.empty(tokens_n * topk * hidden * size + 64, np.uint8)
        start = -raw.ctypes.data % 32 + offset
        ptg = raw[start:start + tokens_n * topk * hidden * size].view(DTYPES[tt]).reshape(tokens_n * topk, hidden)
        got = executable.run(feeds, outputs={"ptg": ptg, "pg": np.empty((tokens_n, topk), DTYPES[tt])})
        assert bits_equal(got["ptg"], want["ptg"]) and bits_equal(got["pg"], want["pg"]), offset


@pytest.mark.parametrize("tt", list(DTYPES))
def test_moe_native_without_probs(tt):
    rng = np.random.default_rng(1)
    s = rng.permutation(6).astype(np.int32)
    feeds = {"tokens": rng.standard_normal((6, 4)).astype(DTYPES[tt]), "indices": s}
    g = moe_graph(6, 4, 6, None, tt)
    assert bits_equal(geir.run(g, feeds, runtime="onnxruntime")["y"], geir.run(g, feeds)["y"])
    g = moe_grad_graph(None, (6, 4), 6, None, tt)
    feeds = {"dy": feeds["tokens"], "indices": s}
    ours, theirs = geir.run(g, feeds), geir.run(g, feeds, runtime="onnxruntime")
    assert bits_equal(theirs["ptg"], ours["ptg"]) and bits_equal(theirs["pg"], ours["pg"])


def test_bad_shapes_reaching_a_kernel_raise_not_crash():
    """A model that bypasses geir's checks: the kernel returns an ONNX Runtime error, the process lives on."""
    result = run_isolated("""
        import numpy as np, onnxruntime as ort
        from onnx import helper, TensorProto as T
        from geir.runtimes.onnxruntime import native_library
        node = helper.make_node("InplacePartialRotaryMulGrad", ["x", "c", "c"], ["y"], domain="ai.cann",
                                rotary_mode=1, partial_slice=[0, 8])
        graph = helper.make_graph([node], "bad", [helper.make_tensor_value_info("x", T.FLOAT, [1, 1, 1, 8]),
                                  helper.make_tensor_value_info("c", T.FLOAT, [1, 1, 1, 6])],
                                  [helper.make_tensor_value_info("y", T.FLOAT, [1, 1, 1, 8])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.cann", 1)])
        options = ort.SessionOptions()
        options.register_custom_ops_library(native_library())
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        try:
            session.run(None, {"x": np.zeros((1, 1, 1, 8), np.float32), "c": np.zeros((1, 1, 1, 6), np.float32)})
        except Exception as exc:
            print("raised:", exc)
        node = helper.make_node("MoeTokenUnpermute", ["p", "s"], ["y"], domain="ai.cann")
        graph = helper.make_graph([node], "bad2", [helper.make_tensor_value_info("p", T.FLOAT, [3, 2]),
                                  helper.make_tensor_value_info("s", T.INT32, [3])],
                                  [helper.make_tensor_value_info("y", T.FLOAT, [3, 2])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.cann", 1)])
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        try:
            session.run(None, {"p": np.zeros((3, 2), np.float32), "s": np.array([0, 7, 1], np.int32)})
        except Exception as exc:
            print("raised:", exc)
        print("alive")
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "alive"
    assert "InplacePartialRotaryMulGrad (geir native kernel): cos dim 3 is 6, expected the slice length 8" in result.stdout
    assert "MoeTokenUnpermute (geir native kernel): sorted_indices position 1: expected a value in [0, 3), got 7" \
        in result.stdout


def test_geir_native_0_runs_the_function_bodies():
    result = run_isolated("""
        import numpy as np, geir
        from geir.runtimes.onnxruntime import native_library, native_status
        b = geir.GraphBuilder("g")
        x = b.input("x", "bfloat16", (2, 3, 4, 16))
        c = b.input("c", "bfloat16", (1, 3, 1, 16))
        b.output(b.InplacePartialRotaryMulGrad(x, c, c, rotary_mode=3, partial_slice=[0, 16]), "y")
        g = b.build()
        rng = np.random.default_rng(0)
        import ml_dtypes
        feeds = {"x": rng.standard_normal((2, 3, 4, 16)).astype(ml_dtypes.bfloat16),
                 "c": rng.uniform(-1, 1, (1, 3, 1, 16)).astype(ml_dtypes.bfloat16)}
        same = np.array_equal(geir.run(g, feeds, runtime="onnxruntime")["y"].view(np.uint16),
                              geir.run(g, feeds)["y"].view(np.uint16))
        print(native_library(), native_status(), same)
    """, env={"GEIR_NATIVE": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None function bodies only (disabled by GEIR_NATIVE=0) True"


def test_unbuildable_library_falls_back_and_says_so_once():
    result = run_isolated("""
        import warnings
        warnings.simplefilter("always")
        import numpy as np, geir
        from geir.runtimes.onnxruntime import native_library, native_status
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = native_library(), native_library()
        print(first, second, len(caught), native_status())
    """, env={"CC": "/bin/false", "GEIR_CACHE_DIR": "/tmp/geir-test-cache-empty"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("None None 1 function bodies only (RuntimeError: /bin/false failed")
