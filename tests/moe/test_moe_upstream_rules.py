"""MoE unpermute rules CANN's code states that geir lacked or had wrong (issue 27, item 3), each with its source."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import geir
from moe.helpers import moe_grad_graph, moe_graph

SMALL = ("ascend310p", "kirinx90", "kirin9030")


def test_padded_mode_is_ignored_with_a_warning_at_build():
    """ops-transformer moe/moe_token_unpermute/op_host/moe_token_unpermute_tiling.cpp never reads padded_mode, and
    moe_token_unpermute_grad_tiling.cpp reads it but sets ``paddedModeKey = 0`` (@c29bc106, 2025-11-15): the A2/A3
    kernels compute as with padded_mode=False, so that is the reference semantics (was the error MU-S3/MG-S6)."""
    with pytest.warns(geir.GeirWarning, match=r"\[MU-W1\] MoeTokenUnpermute 'node': attribute 'padded_mode': "
                                              r"expected False, got True; ignored"):
        padded = moe_graph(6, 5, 6, (3, 2), padded_mode=True)
    with pytest.warns(geir.GeirWarning, match=r"\[MG-W1\] MoeTokenUnpermuteGrad 'node': attribute 'padded_mode'"):
        padded_grad = moe_grad_graph((6, 5), (3, 5), 6, (3, 2), padded_mode=True)
    plain, plain_grad = moe_graph(6, 5, 6, (3, 2)), moe_grad_graph((6, 5), (3, 5), 6, (3, 2))
    rng = np.random.default_rng(0)
    for g, p in ((padded, plain), (padded_grad, plain_grad)):
        feeds = {v.name: (rng.permutation(6).astype(np.int32) if v.dtype.value == "int32"
                          else rng.standard_normal(v.shape).astype(np.float32)) for v in g.inputs}
        for runtime in ("numpy", "onnxruntime"):
            got, want = geir.run(g, feeds, runtime=runtime), geir.run(p, feeds, runtime=runtime)
            assert all(np.array_equal(got[k], want[k]) for k in want)


def test_padded_mode_rows_warn_on_a2_a3_and_refuse_on_ascend950():
    """aclnn_moe_token_unpermute.cpp and aclnn_moe_token_unpermute_grad.cpp (op_host/op_api, @c29bc106): on
    ASCEND910_95 ``CHECK_RET(paddedMode == false, ACLNN_ERR_PARAM_INVALID)`` before re-routing to
    MoeFinalizeRoutingV2(Grad); elsewhere the tiling ignores it: MU-T5/MG-T3 warn there and are errors on 950."""
    with pytest.warns(geir.GeirWarning):
        f, g = moe_graph(6, 5, 6, (3, 2), padded_mode=True), moe_grad_graph((6, 5), (3, 5), 6, (3, 2), padded_mode=True)
    for graph, rule, targets in ((f, "MU-T5", ("ascend910b", "ascend910_93") + SMALL), (g, "MG-T3", ("ascend910b",
                                                                                                    "ascend910_93"))):
        for target in targets:
            with pytest.warns(geir.GeirWarning, match=rf"\[{rule}\] .* on {target}: attribute 'padded_mode'"):
                report = geir.check(graph, target)
            assert [w.rule for w in report.warnings] == [rule]
            assert report.ok or target in SMALL          # H = 5 breaks MU-T4 on the small devices
        report = geir.check(graph, "ascend950")
        assert rule in report.errors[-1].rule and "161002" in str(report) and not report.ok
        assert {v.rule for v in report.errors} == {rule, rule[:3] + "T1"}    # and no graph kernel there (MU/MG-T1)


def test_bf16_tokens_with_f32_probs_warn_with_the_workaround():
    """Issue 27: MoeTokenUnpermuteGrad with bfloat16 tokens and float32 probs returns NaN on the device; MindSpeed's
    unpermute wrapper casts ("make sure permuted_tokens has the same dtype with probs") and torchtitan-npu casts
    around it. A warning at build and a warning row (MG-W2) on the targets with the kernel (ascend910b/_93)."""
    with pytest.warns(geir.GeirWarning, match=r"\[MG-W2\] MoeTokenUnpermuteGrad 'node': input 3 'probs': expected "
                                              r"bfloat16 probs with bfloat16 tokens, got float32; .*cast probs to "
                                              r"bfloat16, or the tokens to float32"):
        g = moe_grad_graph((30, 64), (10, 64), 30, (10, 3), "bfloat16", "float32")
    for target in ("ascend910b", "ascend910_93"):
        with pytest.warns(geir.GeirWarning, match=rf"\[MG-W2\] .* on {target}"):
            report = geir.check(g, target)
        assert report.ok and [(w.rule, w.level) for w in report.warnings] == [("MG-W2", "warning")]
    assert "MG-W2" not in {w.rule for w in geir.check(g, "ascend950").warnings}     # no grad kernel there (MG-T1)
    for tokens, probs in (("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float32")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")                  # past the suite's MG-W2 filter (tests/conftest.py)
            quiet = moe_grad_graph((30, 64), (10, 64), 30, (10, 3), tokens, probs)
            assert not geir.check(quiet, "ascend910b").warnings
        assert not caught, [str(w.message) for w in caught]
