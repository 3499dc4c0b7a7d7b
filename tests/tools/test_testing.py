"""``geir.testing``: CANN's precision standards, the float64 golden, all-runtime agreement, the pytest plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import geir
from geir import testing
from helpers import random_feeds
from moe.helpers import moe_graph
from rotary.helpers import ROPE_GRAD, rotary_graph
from oracles.rotary import rotary_reference


def test_precision_standard_is_canns_table():
    assert [testing.precision_standard("float16", n) for n in (0, 2047, 2048)] == [2 ** -8, 2 ** -8, 2 ** -7]
    assert [testing.precision_standard("bfloat16", n) for n in (0, 2048)] == [2 ** -7, 2 ** -6]
    assert [testing.precision_standard(np.float32, n) for n in (0, 2048, 16383, 16384)] == \
        [2 ** -11, 2 ** -10, 2 ** -10, 2 ** -9]
    with pytest.raises(ValueError, match="expected float16, bfloat16 or float32, got int32"):
        testing.precision_standard("int32")


def test_diff_ratio_counts_the_elements_off_by_more_than_p():
    expected = np.ones(10000, np.float16)
    actual = expected.copy()
    actual[:9] = np.float16(1.01)              # 9 of 10000 off: below 1/1000, passes
    testing.assert_close(actual, expected)
    actual[:10] = np.float16(1.01)             # 10 of 10000: not below 1/1000
    with pytest.raises(AssertionError) as info:
        testing.assert_close(actual, expected, name="y")
    text = str(info.value)
    assert text.startswith("y: 10 of 10000 elements fail diff_ratio (float16): elements with relative error > 0.001 must "
                           "be fewer than 0.001 of all (here 0.001), and no infinity or NaN may differ; worst at index "
                           "(0,): actual np.float64(1.009765625), "
                           "expected np.float64(1.0), absolute error 0.00976562, relative error 0.00976562")
    f32 = np.ones(100, np.float32)
    with pytest.raises(AssertionError, match=r"diff_ratio \(float32\): elements with relative error > 0.0001"):
        testing.assert_close(f32 * np.float32(1.001), f32)


@pytest.mark.parametrize("got, want", [(np.nan, 1.0), (np.inf, 1.0), (-np.inf, np.inf), (1.0, np.nan),
                                       (np.nan, np.inf)])
def test_diff_ratio_never_passes_a_special_value_that_differs(got, want):
    """One element in 20,000 is below diff_ratio's 1/10,000, yet an infinity or NaN that differs is no rounding."""
    expected = np.ones(20000, np.float32)
    actual = expected.copy()
    actual[7], expected[7] = got, want
    with pytest.raises(AssertionError, match="no infinity or NaN may differ"):
        testing.assert_close(actual, expected)
    actual[7] = expected[7]
    testing.assert_close(actual, expected)


def test_precision_standard_and_bit_exact_name_the_worst_element():
    expected = np.zeros((2, 3), ml_dtypes.bfloat16)
    actual = expected.copy()
    actual[1, 2] = 0.005
    testing.assert_close(actual, expected, standard="precision_standard")   # 0.005 <= 2**-7
    actual[0, 1] = 0.012
    with pytest.raises(AssertionError, match=r"1 of 6 elements fail precision_standard \(bfloat16, compute_count 0\): "
                                             r"\|error\| <= 0.0078125; worst at index \(0, 1\)"):
        testing.assert_close(actual, expected, standard="precision_standard")
    testing.assert_close(actual, expected, standard="precision_standard", compute_count=4096)   # 0.012 <= 2**-6
    nan = np.array([np.nan, 1.0], np.float32)
    testing.assert_close(nan, nan.copy(), standard="bit_exact")
    with pytest.raises(AssertionError, match=r"1 of 2 elements fail bit_exact"):
        testing.assert_close(np.array([0.0, 1.0], np.float32), np.array([-0.0, 1.0], np.float32), standard="bit_exact")
    with pytest.raises(AssertionError, match=r"shape \[2\] differs from the expected \[3\]"):
        testing.assert_close(np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="standard: expected one of diff_ratio, precision_standard, bit_exact"):
        testing.assert_close(nan, nan, standard="ulp")


def test_bit_exact_compares_values_and_never_casts_the_expected_one():
    for actual, expected in ((np.array([1], np.int32), [1.7]), (np.array([0], np.uint8), [256.0]),
                             (np.array([True]), [5.0]), (np.array([2 ** 63 + 1], np.uint64), [float(2 ** 63)]),
                             (np.array([-1], np.int64), np.array([2 ** 64 - 1], np.uint64)),
                             (np.array([0.1], np.float32), [0.1]), (np.array([-np.inf], np.float16), [-2.0 ** 63])):
        with pytest.raises(AssertionError, match=r"1 of 1 elements fail bit_exact: every element is exactly the "
                                                 r"expected value \(actual \w+, expected \w+: equal as numbers"):
            testing.assert_close(actual, np.asarray(expected), standard="bit_exact")
    with pytest.raises(AssertionError, match=r"worst at index \(0,\): actual np.int32\(1\), expected np.float64\(1.7\)"):
        testing.assert_close(np.array([1], np.int32), [1.7], standard="bit_exact")
    with pytest.raises(AssertionError, match=r"actual np.int64\(4611686018427387905\), expected np.int64\("
                                             r"4611686018427387904\), absolute error 1,"):  # exact beyond 2**53
        testing.assert_close(np.array([2 ** 62 + 1]), np.array([2 ** 62]), standard="bit_exact")
    testing.assert_close(np.array([1, 0], np.int32), np.array([1.0, -0.0]), standard="bit_exact")   # equal numbers
    testing.assert_close(np.array([True, False]), np.array([1, 0], np.uint64), standard="bit_exact")
    testing.assert_close(np.array([0.5, np.nan], np.float16), np.array([0.5, np.nan]), standard="bit_exact")
    with pytest.raises(ValueError, match=r"actual: dtype: expected bool, an integer or a floating dtype, got complex64"):
        testing.assert_close(np.zeros(2, np.complex64), np.zeros(2, np.complex64), standard="bit_exact")


def test_special_values_layouts_and_shapes():
    inf = np.array([np.inf, -np.inf, np.nan, 1.0], np.float16)
    for standard in testing.STANDARDS:
        testing.assert_close(inf, inf.copy(), standard=standard)        # equal infinities and NaN positions pass
        with pytest.raises(AssertionError, match=r"1 of 4 elements fail"):
            testing.assert_close(inf, inf[[1, 1, 2, 3]], standard=standard)                # inf against -inf
        with pytest.raises(AssertionError, match=r"2 of 4 elements fail"):
            testing.assert_close(inf, inf[[0, 1, 3, 2]], standard=standard)                # NaNs elsewhere
        with pytest.raises(AssertionError, match=r"shape \[1\] differs from the expected \[\]"):
            testing.assert_close(inf[:1], inf[0], standard=standard)                        # no broadcast
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for actual in (x.T, x[:, ::-2], x.astype(">f4"), np.float32(3.0), x[:0]):
        testing.assert_close(actual, np.array(actual, actual.dtype.newbyteorder("=")), standard="bit_exact")
    testing.assert_close(x.astype(">f2"), x.astype(np.float16), standard="precision_standard")   # '>f2' is float16


def test_run_all_runtimes_passes_equal_overflowing_outputs_and_checks_dtypes(monkeypatch):
    b = geir.GraphBuilder("overflow")
    x = b.input("x", "float16", (2, 3))
    b.output(b.op("Mul", x, x), "y")
    g = b.build()
    out = testing.run_all_runtimes(g, {"x": np.full((2, 3), 300, np.float16)})      # 300 * 300 is inf in float16
    assert np.isposinf(out["y"]).all()
    from geir.runtimes.onnxruntime import _session

    real_run = _session.OnnxRuntimeExecutable.run
    monkeypatch.setattr(_session.OnnxRuntimeExecutable, "run",
                        lambda self, feeds: {k: v.astype(np.float32) for k, v in real_run(self, feeds).items()})
    with pytest.raises(AssertionError, match=r"output 'y' on onnxruntime vs numpy: dtype float32 differs from float16"):
        testing.run_all_runtimes(g, {"x": np.ones((2, 3), np.float16)})


# -- the kit's own properties: every dtype, shape (0-d, empty), special value and memory layout -------------------
DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                np.uint64, np.float16, np.float32, np.float64, ml_dtypes.bfloat16)]
POOL = [0, -0.0, 1, -1, 0.5, 1.7, 2, 127, 128, 255, 256, -129, 65504, 65520, 2 ** 24 + 1, 2 ** 31, 2 ** 53 + 1,
        2 ** 63, 2 ** 63 + 1, 2 ** 64 - 1, -2 ** 63, 1e-8, 3.0e38, 1e300, math.inf, -math.inf, math.nan]
LAYOUTS = ("contiguous", "transposed", "strided", "reversed", "big-endian")


def _array(values: list, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """``values`` in ``dtype``; a value an integer dtype cannot hold becomes 0 (the oracle reads the array back)."""
    if dtype.kind in "biu":
        info = np.iinfo(dtype) if dtype.kind != "b" else None
        held = [int(v) if isinstance(v, int) or math.isfinite(v) and v == int(v) else 0 for v in values]
        held = [v if (info is None and v in (0, 1)) or (info and info.min <= v <= info.max) else 0 for v in held]
        return np.array(held, dtype).reshape(shape)
    with np.errstate(over="ignore"):
        return np.array([float(v) for v in values], np.float64).astype(dtype).reshape(shape)


def _laid_out(array: np.ndarray, layout: str) -> np.ndarray:
    """The same values in another memory layout."""
    if layout == "transposed":
        return np.array(array.T, order="C").T
    if layout == "strided":
        big = np.zeros(tuple(2 * n for n in array.shape), array.dtype)
        big[(slice(None, None, 2),) * array.ndim] = array
        return big[(slice(None, None, 2),) * array.ndim]
    if layout == "reversed":
        flipped = np.array(array[(slice(None, None, -1),) * array.ndim])
        return flipped[(slice(None, None, -1),) * array.ndim]
    if layout == "big-endian" and array.dtype.kind in "iuf":
        return array.astype(array.dtype.newbyteorder(">"))
    return array


def _python(array: np.ndarray) -> list:
    """The elements as Python numbers (exact: int for integers and bool, float for float16..float64)."""
    floating = array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16
    return [float(v) if floating else int(v) for v in array.reshape(-1)]


def _equal(x: float | int, y: float | int) -> bool:
    """The bit_exact rule for one pair, by Python's exact int/float comparison."""
    if isinstance(x, float) and isinstance(y, float):
        return math.isnan(x) and math.isnan(y) or x == y and math.copysign(1, x) == math.copysign(1, y)
    return x == y


@st.composite
def _pairs(draw, same_dtype: bool = False):
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    size = math.prod(shape)
    a_dtype = draw(st.sampled_from(DTYPES))
    e_dtype = a_dtype if same_dtype or draw(st.booleans()) else draw(st.sampled_from(DTYPES))
    a_values = draw(st.lists(st.sampled_from(POOL), min_size=size, max_size=size))
    e_values = [v if keep else other for v, keep, other in zip(a_values, draw(st.lists(
        st.booleans(), min_size=size, max_size=size)), draw(st.lists(st.sampled_from(POOL), min_size=size, max_size=size)))]
    actual, expected = _array(a_values, a_dtype, shape), _array(e_values, e_dtype, shape)
    return actual, expected, draw(st.sampled_from(LAYOUTS)), draw(st.sampled_from(LAYOUTS))


def _bit_exact_is_the_elementwise_rule(pair) -> None:
    actual, expected, a_layout, e_layout = pair
    failing = sum(not _equal(x, y) for x, y in zip(_python(actual), _python(expected)))
    try:
        testing.assert_close(_laid_out(actual, a_layout), _laid_out(expected, e_layout), standard="bit_exact")
    except AssertionError as exc:
        assert failing and str(exc).startswith(f"output: {failing} of {actual.size} elements fail bit_exact"), exc
    else:
        assert not failing
    testing.assert_close(_laid_out(actual, a_layout), _laid_out(actual, e_layout), standard="bit_exact")


def _precision_standard_is_the_elementwise_rule(pair) -> None:
    actual, expected, a_layout, e_layout = pair
    if actual.dtype.name not in ("float16", "bfloat16", "float32"):
        with np.errstate(over="ignore"):
            actual, expected = actual.astype(np.float32), expected.astype(np.float32)
    bound = testing.precision_standard(actual.dtype.name)
    failing = sum(not (math.isnan(x) and math.isnan(y) or x == y or abs(x - y) <= bound)
                  for x, y in zip(_python(actual), _python(expected)))
    for standard in ("precision_standard", "diff_ratio"):
        testing.assert_close(_laid_out(actual, a_layout), _laid_out(actual, e_layout), standard=standard)
    try:
        testing.assert_close(_laid_out(actual, a_layout), _laid_out(expected, e_layout), standard="precision_standard")
    except AssertionError as exc:
        assert failing and f": {failing} of {actual.size} elements fail precision_standard" in str(exc), exc
    else:
        assert not failing


def _never_broadcasts(pair) -> None:
    actual = pair[0]
    for other in (actual[None], actual[..., None], np.zeros((), actual.dtype), np.zeros((1,) * actual.ndim, actual.dtype)):
        if other.shape != actual.shape:                  # each broadcasts against actual; none may be compared
            for standard in testing.STANDARDS:
                for a, e in ((actual, other), (other, actual)):
                    with pytest.raises(AssertionError, match=r"shape .* differs from the expected"):
                        testing.assert_close(a, e, standard=standard, dtype="float32")


test_bit_exact_is_the_elementwise_rule = settings(max_examples=300)(given(_pairs())(_bit_exact_is_the_elementwise_rule))
test_precision_standard_is_the_elementwise_rule = settings(max_examples=200)(
    given(_pairs(same_dtype=True))(_precision_standard_is_the_elementwise_rule))
test_a_shape_mismatch_never_broadcasts = settings(max_examples=50)(given(_pairs())(_never_broadcasts))
test_bit_exact_is_the_elementwise_rule_long = pytest.mark.slow(settings(max_examples=4000)(
    given(_pairs())(_bit_exact_is_the_elementwise_rule)))
test_precision_standard_is_the_elementwise_rule_long = pytest.mark.slow(settings(max_examples=3000)(
    given(_pairs(same_dtype=True))(_precision_standard_is_the_elementwise_rule)))


def test_reference_is_the_float64_math_rounded_once():
    g = rotary_graph(ROPE_GRAD, (2, 4, 2, 16), (1, 4, 1, 8), "float16", rotary_mode=2, partial_slice=[4, 12])
    feeds = random_feeds(g, seed=5)
    got = testing.reference(g, feeds)["y"]
    want, _ = rotary_reference(*(feeds[k].astype(np.float64) for k in ("x", "cos", "sin")), 2, 4, 12, True)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want.astype(np.float16))


def test_reference_does_not_round_inside_standard_ops():
    b = geir.GraphBuilder("cast_then_rope")
    x = b.input("x", "float32", (2, 8, 2, 16))
    c = b.input("c", "float16", (1, 8, 1, 16))
    x16 = b.op("Cast", x, to=10)                         # to float16: the golden keeps float64 here
    b.output(b.InplacePartialRotaryMulGrad(x16, c, c, rotary_mode=0, partial_slice=[0, 16]), "y")
    g = b.build()
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((2, 8, 2, 16)).astype(np.float32),
             "c": rng.standard_normal((1, 8, 1, 16)).astype(np.float16)}
    golden = testing.reference(g, feeds)["y"]
    c64 = feeds["c"].astype(np.float64)
    want, _ = rotary_reference(feeds["x"].astype(np.float64), c64, c64, 0, 0, 16, True)
    np.testing.assert_array_equal(golden, want.astype(np.float16))
    rounded, _ = rotary_reference(feeds["x"].astype(np.float16).astype(np.float64), c64, c64, 0, 0, 16, True)
    assert not np.array_equal(golden, rounded.astype(np.float16))     # rounding at the Cast would be seen


def test_reference_applies_the_same_data_checks():
    g = moe_graph(4, 8, 4)
    feeds = random_feeds(g)
    feeds["indices"] = np.array([0, 1, 1, 3], np.int32)
    with pytest.raises(geir.ExecutionError) as ours:
        testing.reference(g, feeds)
    with pytest.raises(geir.ExecutionError) as runtime:
        geir.run(g, feeds)
    assert str(ours.value) == str(runtime.value)


def test_run_all_runtimes_agrees_and_catches_a_runtime_that_does_not(monkeypatch):
    g = rotary_graph(ROPE_GRAD, (2, 4, 2, 16), (1, 4, 1, 8), "bfloat16", rotary_mode=1, partial_slice=[0, 8])
    feeds = random_feeds(g, seed=2)
    out = testing.run_all_runtimes(g, feeds)
    np.testing.assert_array_equal(out["y"], geir.run(g, feeds)["y"])
    from geir.runtimes.onnxruntime import _session

    real_run = _session.OnnxRuntimeExecutable.run

    def one_ulp_off(self, feeds):
        result = real_run(self, feeds)
        y = result["y"].copy()
        y.view(np.uint16)[0, 0, 0, 0] ^= 1
        return {**result, "y": y}

    monkeypatch.setattr(_session.OnnxRuntimeExecutable, "run", one_ulp_off)
    with pytest.raises(AssertionError, match=r"output 'y' on onnxruntime vs numpy: 1 of 256 elements fail bit_exact"):
        testing.run_all_runtimes(g, feeds)


PLUGIN_TEST = """
import numpy as np, geir

def test_rope_grad_on_every_runtime(geir_runtime):
    b = geir.GraphBuilder("rope")
    dy, c = b.input("dy", "float32", (1, 2, 1, 4)), b.input("c", "float32", (1, 2, 1, 4))
    b.output(b.InplacePartialRotaryMulGrad(dy, c, c, rotary_mode=1, partial_slice=[0, 4]), "dx")
    feeds = {"dy": np.ones((1, 2, 1, 4), np.float32), "c": np.ones((1, 2, 1, 4), np.float32)}
    out = geir.run(b.build(), feeds, runtime=geir_runtime)["dx"]
    geir.testing.assert_close(out, np.tile([2.0, 0.0], 4).reshape(1, 2, 1, 4).astype(np.float32))
"""


@pytest.mark.parametrize("args, expect", [([], "2 passed"),
                                          pytest.param(["--geir-runtime", "numpy"], "1 passed", marks=pytest.mark.slow),
                                          pytest.param(["--geir-runtime", "tvm"],
                                                       "--geir-runtime 'tvm': expected one of numpy",
                                                       marks=pytest.mark.slow)])   # a pytest subprocess each, 6 s
def test_the_pytest_plugin_parametrises_over_runtimes(tmp_path, args, expect):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(PLUGIN_TEST))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path), *args],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})
    assert expect in result.stdout + result.stderr, result.stdout + result.stderr


def _one_ulp_off_on_onnxruntime(monkeypatch):
    """ONNX Runtime's executables return the first floating output one ulp away (in its last element)."""
    from geir.runtimes.onnxruntime import OnnxRuntimeExecutable

    real = OnnxRuntimeExecutable.run

    def nudged(self, feeds, outputs=None):
        results = real(self, feeds, outputs)
        name = next(k for k, v in results.items() if v.dtype == np.float32)
        results[name] = results[name].copy()
        results[name].reshape(-1)[-1] = np.nextafter(results[name].reshape(-1)[-1], np.float32(np.inf))
        return results
    monkeypatch.setattr(OnnxRuntimeExecutable, "run", nudged)


def test_run_all_runtimes_holds_ops_exact_across_runtimes_to_the_bit(monkeypatch):
    """Exactness is the schema's word: rotary says every runtime gives the same bits, MoE does not (its weighted
    sums may round in another order), so one ulp fails the first and passes the second."""
    rope = rotary_graph(ROPE_GRAD, (1, 2, 2, 8), (1, 2, 1, 8), rotary_mode=1, partial_slice=[0, 8])
    moe = moe_graph(6, 4, 6, probs_shape=(3, 2))
    assert all(n.schema.exact_across_runtimes for n in rope.nodes)
    assert not any(n.schema.exact_across_runtimes for n in moe.nodes)
    testing.run_all_runtimes(rope, random_feeds(rope))
    _one_ulp_off_on_onnxruntime(monkeypatch)
    with pytest.raises(AssertionError, match="fail bit_exact"):
        testing.run_all_runtimes(rope, random_feeds(rope))
    feeds = random_feeds(moe)
    feeds[moe.inputs[1].name] = np.random.default_rng(0).permutation(6).astype(np.int32)
    testing.run_all_runtimes(moe, feeds)
