"""Every device the op definitions register, which ops have kernels where, and the level of every rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import geir
from geir.ir._registry import all_schemas
from geir.schemas.targets import LEVELS, TARGET_ROWS, TARGETS, ops_with_kernels
from moe.helpers import moe_grad_graph, moe_graph
from rotary.helpers import ROPE, rotary_graph
from sparse_attention.helpers import sfa_graph

ROOT = Path(__file__).parents[2]


def grad_feeds(S1=4, S2=8, N1=4, D=8, D2=8, K=2, Dr=0):
    """BSND grad inputs of zeros (B=1, N2=1) for rule checks."""
    z = lambda *shape, dtype=np.float16: np.zeros(shape, dtype)  # noqa: E731
    out = z(1, S1, N1, D2)
    feeds = {"query": z(1, S1, N1, D), "key": z(1, S2, 1, D), "sparse_indices": z(1, S1, 1, K, dtype=np.int32),
             "d_out": out, "out": out.copy(), "softmax_max": z(1, 1, S1, N1, dtype=np.float32),
             "softmax_sum": z(1, 1, S1, N1, dtype=np.float32), "value": z(1, S2, 1, D2)}
    if Dr:
        feeds["query_rope"], feeds["key_rope"] = z(1, S1, N1, Dr), z(1, S2, 1, Dr)
    return feeds
ROTARY, MOE, SFA = ("InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"), (
    "MoeTokenUnpermute", "MoeTokenUnpermuteGrad"), ("SparseFlashAttention", "SparseFlashAttentionGrad")


def test_the_kernel_table_of_every_target():
    """The families named here, as CANN ships them (another family's ops may join any target)."""
    ours = {*ROTARY, *MOE, *SFA}
    table = {target: set(ops_with_kernels(target)) & ours for target in TARGETS}
    assert table["ascend910b"] == table["ascend910_93"] == {ROTARY[0], *MOE, *SFA}
    assert table["ascend950"] == {*ROTARY, *SFA}
    for small in ("ascend310p", "kirinx90", "kirin9030"):
        assert table[small] == {MOE[0]}


def test_every_op_says_where_cann_has_its_kernel():
    assert {op for target in TARGETS for op in ops_with_kernels(target)} == {s.op_type for s in all_schemas()}


@pytest.mark.parametrize("target, graph, rule", [
    ("kirinx90", lambda: rotary_graph(ROPE, (1, 2, 1, 8), (1, 2, 1, 8), rotary_mode=1, partial_slice=[0, 8]), "RP-T1"),
    ("kirin9030", lambda: moe_grad_graph((4, 128), (4, 128), 4), "MG-T1"),
    ("ascend310p", lambda: sfa_graph(grad_feeds(), "SparseFlashAttentionGrad", scale_value=0.1)[0], "SA-T0"),
])
def test_an_op_without_a_kernel_on_a_target_names_the_op_and_the_target(target, graph, rule):
    report = geir.check(graph(), target)
    assert not report.ok and report.rules() == {rule}
    (violation,) = report.violations
    assert violation.level == "error" and f"kernel (" in violation.message and f"got {target}" in violation.message


@pytest.mark.parametrize("dtype, hidden, topk, rules", [
    ("float16", 256, 8, set()), ("float32", 10240, 512, set()),
    ("bfloat16", 256, 8, {"MU-T3"}), ("float16", 200, 8, {"MU-T4"}), ("float16", 10368, 8, {"MU-T4"}),
    ("float32", 256, 513, {"MU-T2"}),
])
@pytest.mark.parametrize("target", ["ascend310p", "kirinx90", "kirin9030"])
def test_moe_unpermute_on_the_small_devices(target, dtype, hidden, topk, rules):
    g = moe_graph(topk * 2, hidden, topk * 2, (2, topk), dtype, dtype)
    report = geir.check(g, target)
    assert report.rules() == rules and report.ok == (not rules), str(report)


def test_levels_follow_the_source_of_each_rule():
    for rule in TARGET_ROWS.all():
        assert rule.level in LEVELS and rule.src
        if rule.warning:
            assert rule.level == "warning"
        elif rule.src.startswith("doc"):
            assert rule.level == "unsupported", rule.rule
        else:
            assert rule.level == "error", rule.rule


def test_unsupported_passes_unless_strict_and_reports_level_and_source():
    g, _ = sfa_graph(grad_feeds(D=128, D2=128, K=2048, S2=4096), "SparseFlashAttentionGrad", scale_value=0.1,
                     sparse_block_size=1)
    lenient = geir.check(g, "ascend910b")
    assert {v.rule for v in lenient.unsupported} >= {"SA-T5"} and "SA-T5" not in {v.rule for v in lenient.errors}
    text = str(lenient)
    assert "unsupported (doc (A2/A3 tiling runs D = 128)): [SA-T5]" in text
    strict = geir.check(g, "ascend910b", strict=True)
    assert not strict.ok and "(strict)" in str(strict)
    on_950 = geir.check(g, "ascend950")
    assert "SA-T5" in {v.rule for v in on_950.errors} and not on_950.ok


def test_check_strict_on_the_command_line(tmp_path):
    g, _ = sfa_graph(grad_feeds(D=128, D2=128, K=2048, S2=4096, N1=4, Dr=64), "SparseFlashAttentionGrad",
                     scale_value=0.1)
    path = tmp_path / "grad.onnx"
    geir.save_onnx(g, str(path))
    report = geir.check(g, "ascend910b")
    assert report.ok and report.unsupported, str(report)          # only documented limits are broken
    run = lambda *extra: subprocess.run([sys.executable, "-m", "geir", "check", str(path), "--target", "ascend910b",  # noqa: E731
                                         *extra], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run().returncode == 0 and run("--strict").returncode == 1
