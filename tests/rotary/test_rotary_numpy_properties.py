"""Hypothesis: random shapes, broadcast patterns, slices, modes and dtypes against the float64 reference."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geir
from geir import GraphError
from oracles.numerics import assert_matches_reference, bits_equal
from oracles.rotary import rotary_reference
from rotary.helpers import ROPE, ROPE_GRAD, empty_grad_slices_expected, rotary_graph

DTYPES = ("float32", "float16", "bfloat16")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def rotary_cases(draw):
    op = draw(st.sampled_from([ROPE, ROPE_GRAD]))
    mode = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(3)) + (draw(st.integers(1, 48)),)
    unit = 4 if mode == 2 else 2
    length = unit * draw(st.integers(0, shape[3] // unit))
    start = draw(st.integers(0, shape[3] - length))
    keep = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    table = length if length or op == ROPE else draw(st.integers(1, shape[3]))  # grad: no zero dims (RP-S6)
    cos_shape = tuple(d if k else 1 for d, k in zip(shape[:3], keep)) + (table,)
    dtype = draw(st.sampled_from(DTYPES))
    if op == ROPE:
        cos_dtype = draw(st.sampled_from([dtype, "float32"]))
    else:
        cos_dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    return op, mode, shape, cos_shape, (start, start + length), dtype, cos_dtype, seed


@empty_grad_slices_expected
@SETTINGS
@given(rotary_cases())
def test_random_cases_match_the_reference(case):
    op, mode, shape, cos_shape, (start, end), dtype, cos_dtype, seed = case
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 4).astype(geir.as_dtype(dtype).numpy)
    cos = rng.uniform(-1, 1, cos_shape).astype(geir.as_dtype(cos_dtype).numpy)
    sin = rng.uniform(-1, 1, cos_shape).astype(geir.as_dtype(cos_dtype).numpy)
    g = rotary_graph(op, shape, cos_shape, dtype, cos_dtype, rotary_mode=mode, partial_slice=[start, end])
    y = geir.run(g, {"x": x, "cos": cos, "sin": sin})["y"]
    ref, mag = rotary_reference(x, cos, sin, mode, start, end, op == ROPE_GRAD)
    assert bits_equal(y[..., :start], x[..., :start]) and bits_equal(y[..., end:], x[..., end:])
    assert_matches_reference(y[..., start:end], ref[..., start:end], mag[..., start:end], str(case))


@empty_grad_slices_expected               # a grad with slice [0, 0] is valid and warns (RP-W1)
@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from([ROPE, ROPE_GRAD]),
       shape=st.lists(st.integers(0, 6), min_size=3, max_size=5),
       cos_shape=st.lists(st.integers(0, 6), min_size=3, max_size=5),
       mode=st.integers(-1, 5),
       pslice=st.lists(st.integers(-2, 8), max_size=3))
def test_the_verifier_accepts_or_explains_never_crashes(op, shape, cos_shape, mode, pslice):
    try:
        g = rotary_graph(op, shape, cos_shape, rotary_mode=mode, partial_slice=pslice)
    except GraphError as err:
        assert err.rule is not None and err.rule.startswith(("RP-S", "SCH-")), err
        assert str(err).startswith(f"[{err.rule}] {op} 'node': ")
        return
    feeds = {"x": np.ones(shape, np.float32), "cos": np.ones(cos_shape, np.float32), "sin": np.ones(cos_shape, np.float32)}
    assert geir.run(g, feeds)["y"].shape == tuple(shape)
