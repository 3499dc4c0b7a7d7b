"""The rotary family's one statement of its pairs (``schemas/rotary/rotation.py``), and every
implementation checked against it: the NumPy kernel, the ONNX body and the C kernel, bit for bit."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import geir
from geir.schemas.rotary import rotate, rotation_tables
from helpers import random_feeds
from native_helpers import requires_compiler
from oracles.numerics import assert_matches_reference, bits_equal
from oracles.onnx_runners import run_onnxruntime
from oracles.rotary import pair_indices, rotary_reference
from rotary.helpers import ROPE, ROPE_GRAD, rotary_graph

LENGTHS = (4, 8, 16, 64)
CASES = [(op, mode, dtype, cos_dtype, pslice)
         for op, combos in ((ROPE, [("float32", "float32"), ("float16", "float16"), ("bfloat16", "float32")]),
                            (ROPE_GRAD, [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "bfloat16")]))
         for dtype, cos_dtype in combos for mode in range(4) for pslice in ((0, 16), (4, 28))]


@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("length", LENGTHS)
def test_tables_are_the_spec_pairs(mode, length):
    """partner is an involution pairing exactly the spec's (a, b) pairs; sign is +1 on a, -1 on b."""
    t = rotation_tables(mode, length)
    a, b = pair_indices(mode, length)            # the float64 oracle's transcription of spec 2.4
    assert np.array_equal(t.partner[a], b) and np.array_equal(t.partner[b], a)
    assert np.array_equal(t.partner[t.partner], np.arange(length))
    assert np.all(t.sign[a] == 1) and np.all(t.sign[b] == -1)
    assert sorted(t.layout.tolist()) == list(range(length))
    if mode == 3:      # half-layout position k sits at 2k, position k + L/2 at 2k + 1
        assert np.array_equal(t.layout[a], 2 * a) and np.array_equal(t.layout[b], 2 * a + 1)
    else:
        assert np.array_equal(t.layout, np.arange(length))


@pytest.mark.parametrize("op, mode, dtype, cos_dtype, pslice", CASES[::3])
def test_statement_matches_the_float64_oracle(op, mode, dtype, cos_dtype, pslice):
    g = rotary_graph(op, (2, 3, 2, 32), (1, 3, 1, pslice[1] - pslice[0]), dtype, cos_dtype, rotary_mode=mode,
                     partial_slice=list(pslice))
    f = random_feeds(g, seed=mode)
    got = rotate(f["x"], f["cos"], f["sin"], mode, pslice, grad=op == ROPE_GRAD)
    want, magnitude = rotary_reference(*(f[k].astype(np.float64) for k in ("x", "cos", "sin")), mode, *pslice,
                                       op == ROPE_GRAD)
    assert_matches_reference(got, want, magnitude, f"{op} mode {mode} {dtype}")


def _statement(graph: geir.Graph, feeds: dict[str, np.ndarray]) -> np.ndarray:
    node = graph.nodes[0]
    return rotate(feeds["x"], feeds["cos"], feeds["sin"], node.attributes["rotary_mode"],
                  node.attributes["partial_slice"], grad=node.op_type == ROPE_GRAD)


@pytest.mark.parametrize("op, mode, dtype, cos_dtype, pslice", CASES)
def test_numpy_kernel_and_onnx_body_are_the_statement(op, mode, dtype, cos_dtype, pslice):
    g = rotary_graph(op, (2, 3, 2, 32), (2, 1, 1, pslice[1] - pslice[0]), dtype, cos_dtype, rotary_mode=mode,
                     partial_slice=list(pslice))
    feeds = random_feeds(g, seed=mode + 7)
    want = _statement(g, feeds)
    assert bits_equal(geir.run(g, feeds)["y"], want)
    assert bits_equal(run_onnxruntime(geir.to_onnx(g), feeds)["y"], want)   # plain ORT: the function body


@requires_compiler
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("length", LENGTHS)
def test_native_tables_are_the_statement(mode, length):
    from geir.runtimes.onnxruntime import native_library

    lib = ctypes.CDLL(native_library())
    lib.geir_rotary_tables.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    partner, sign = np.empty(length, np.int32), np.empty(length, np.float32)
    lib.geir_rotary_tables(mode, length, partner.ctypes.data, sign.ctypes.data)
    t = rotation_tables(mode, length)
    assert np.array_equal(partner, t.partner) and np.array_equal(sign, t.sign)


@requires_compiler
@pytest.mark.parametrize("op, mode, dtype, cos_dtype, pslice", CASES[::2])
def test_native_kernel_is_the_statement(op, mode, dtype, cos_dtype, pslice):
    from geir.runtimes.onnxruntime import native_library

    g = rotary_graph(op, (2, 3, 2, 32), (1, 3, 2, pslice[1] - pslice[0]), dtype, cos_dtype, rotary_mode=mode,
                     partial_slice=list(pslice))
    feeds = random_feeds(g, seed=mode + 3)
    counter = ctypes.CDLL(native_library()).geir_native_calls
    counter.restype = ctypes.c_long
    before = counter()
    got = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert counter() > before                    # the C kernel ran, not the body
    assert bits_equal(got, _statement(g, feeds))
