"""``geir.testing``: CANN's precision standards, the float64 golden, all-runtime agreement, the pytest plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import geir
from geir import testing
from helpers import ROPE_GRAD, moe_graph, random_feeds, rotary_graph
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
                           "be fewer than 0.001 of all (here 0.001); worst at index (0,): actual np.float64(1.009765625), "
                           "expected np.float64(1.0), absolute error 0.00976562, relative error 0.00976562")
    f32 = np.ones(100, np.float32)
    with pytest.raises(AssertionError, match=r"diff_ratio \(float32\): elements with relative error > 0.0001"):
        testing.assert_close(f32 * np.float32(1.001), f32)


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


@pytest.mark.parametrize("args, expect", [([], "2 passed"), (["--geir-runtime", "numpy"], "1 passed"),
                                          (["--geir-runtime", "tvm"], "--geir-runtime 'tvm': expected one of numpy")])
def test_the_pytest_plugin_parametrises_over_runtimes(tmp_path, args, expect):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(PLUGIN_TEST))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path), *args],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})
    assert expect in result.stdout + result.stderr, result.stdout + result.stderr
