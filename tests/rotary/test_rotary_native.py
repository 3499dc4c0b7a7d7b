"""The rotary ops' native kernels (rotary.c): they run instead of the function bodies and give the NumPy kernel's
bits for every broadcast pattern, dtype combination, slice and awkward value."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

import geir
from helpers import awkward_values, random_feeds
from native_helpers import native_calls, requires_compiler
from oracles.numerics import bits_equal, bits_equal_or_both_nan
from rotary.helpers import ROPE, ROPE_GRAD, empty_grad_slices_expected, rotary_graph

pytestmark = requires_compiler

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FWD_COMBOS = [("float16", "float16"), ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"),
              ("bfloat16", "float32")]
GRAD_COMBOS = [(d, c) for d in DTYPES for c in DTYPES]


@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("op, dtype, cos_dtype", [(ROPE, d, c) for d, c in FWD_COMBOS]
                         + [(ROPE_GRAD, d, c) for d, c in GRAD_COMBOS])
def test_rotary_native_is_bit_identical_for_every_broadcast_pattern(op, mode, dtype, cos_dtype):
    shape, pslice = (2, 3, 4, 21), (5, 13)
    for keep in itertools.product((False, True), repeat=3):
        cos_shape = tuple(d if k else 1 for d, k in zip(shape[:3], keep)) + (8,)
        g = rotary_graph(op, shape, cos_shape, dtype, cos_dtype, rotary_mode=mode, partial_slice=list(pslice))
        feeds = random_feeds(g, seed=sum(keep) + mode)
        before = native_calls()
        theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
        assert native_calls() > before                # the native kernel ran, not the function body
        assert bits_equal(theirs, geir.run(g, feeds)["y"]), keep


@empty_grad_slices_expected
@pytest.mark.parametrize("pslice", [(0, 0), (7, 71), (0, 128), (124, 128)])
def test_rotary_native_slices(pslice):
    for op in (ROPE, ROPE_GRAD):
        length = pslice[1] - pslice[0]
        g = rotary_graph(op, (1, 3, 2, 128), (1, 3, 1, length or 4), "bfloat16", rotary_mode=1, partial_slice=list(pslice))
        feeds = random_feeds(g, seed=1)
        assert bits_equal(geir.run(g, feeds, runtime="onnxruntime")["y"], geir.run(g, feeds)["y"])


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
    feeds = {v.name: awkward_values(rng, v.shape, DTYPES[dtype]) for v in g.inputs}
    before = native_calls()
    theirs = geir.run(g, feeds, runtime="onnxruntime")["y"]
    assert native_calls() > before and bits_equal_or_both_nan(theirs, geir.run(g, feeds)["y"])
