"""Bad arguments fail at the call that made them, with a geir error naming them; arguments an ONNX or
PyTorch user naturally has (paths, ModelProtos, torch tensors, big-endian arrays) work."""

from __future__ import annotations

import time
import warnings

import ml_dtypes
import numpy as np
import pytest

import geir
from geir import ExecutionError, GraphError
from moe.helpers import moe_graph
from rotary.helpers import ROPE_GRAD, rotary_graph
from sparse_attention.helpers import SFA, AttentionCase, sfa_graph

RUNTIMES = ["numpy", "onnxruntime"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_feeds_must_be_a_mapping(runtime):
    g = moe_graph(2, 2, 2)
    with pytest.raises(ExecutionError, match=r"graph 'moe': feeds: expected a mapping .* got list"):
        geir.run(g, [np.ones((2, 2), np.float32), np.array([1, 0], np.int32)], runtime=runtime)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_big_endian_arrays_are_converted(runtime):
    g = moe_graph(2, 2, 2)
    feeds = {"tokens": np.arange(4, dtype=">f4").reshape(2, 2), "indices": np.array([1, 0], ">i4")}
    np.testing.assert_array_equal(geir.run(g, feeds, runtime=runtime)["y"], [[2, 3], [0, 1]])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_unreadable_feed_names_the_input(runtime):
    g = moe_graph(2, 2, 2)
    with pytest.raises(ExecutionError, match=r"input 'tokens': expected dtype float32, got object"):
        geir.run(g, {"tokens": [object(), object()], "indices": np.array([1, 0], np.int32)}, runtime=runtime)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_torch_tensors_are_fed_as_they_are(runtime):
    torch = pytest.importorskip("torch")
    g = rotary_graph(ROPE_GRAD, (1, 2, 1, 4), (1, 2, 1, 4), "bfloat16", rotary_mode=1, partial_slice=[0, 4])
    x = torch.randn(1, 2, 1, 4, dtype=torch.bfloat16, requires_grad=True)
    c = torch.rand(1, 2, 1, 4).to(torch.bfloat16)
    got = geir.run(g, {"x": x, "cos": c, "sin": c}, runtime=runtime)["y"]
    as_numpy = {"x": x.detach().float().numpy().astype(ml_dtypes.bfloat16),
                "cos": c.float().numpy().astype(ml_dtypes.bfloat16)}
    as_numpy["sin"] = as_numpy["cos"]
    want = geir.run(g, as_numpy)["y"]
    assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_out_of_range_dims_and_attributes_fail_at_build():
    b = geir.GraphBuilder("big")
    with pytest.raises(GraphError, match=r"input 'x': dim 0 .* expected 0 to 9223372036854775807 \(int64\)"):
        b.input("x", "float32", (2**63, 4))
    x = b.input("y", "float32", (1, 1, 1, 4))
    with pytest.raises(GraphError, match=r"\[SCH-3\] .*attribute 'rotary_mode': expected kind Int, got 2\*\*64|"
                                         r"\[SCH-3\] .*attribute 'rotary_mode': expected kind Int, got 18446744073709551616"):
        b.InplacePartialRotaryMulGrad(x, x, x, rotary_mode=2**64, partial_slice=[0, 4])
    with pytest.raises(GraphError, match=r"\[SCH-3\] Transpose .*attribute 'perm': .* got 1180591620717411303424 "
                                         r"\(outside int64\)"):
        b.op("Transpose", x, perm=[2**70, 0, 1, 2])


def test_graph_names_shapes_and_attribute_kinds_are_checked():
    with pytest.raises(GraphError, match="graph name must be a non-empty str"):
        geir.GraphBuilder("")
    b = geir.GraphBuilder("kinds")
    with pytest.raises(GraphError, match=r"shape 'BSND': expected a sequence of dims .* got a string"):
        b.input("x", "float16", "BSND")
    x = b.input("x", "float32", (2, 3))
    with pytest.raises(GraphError, match=r"\[SCH-3\] Transpose .*attribute 'perm': .*got \{0: 1\} \(dict\)"):
        b.op("Transpose", x, perm={0: 1})


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_split_has_one_output_per_part(runtime):
    b = geir.GraphBuilder("split")
    x = b.input("x", "float32", (2, 6))
    halves = b.op("Split", x, axis=1, num_outputs=2)
    parts = b.op("Split", x, b.constant("sizes", np.array([1, 2, 3])), axis=1)
    thirds = b.op("Split", x, axis=0, outputs=2)
    assert len(halves) == 2 and len(parts) == 3 and len(thirds) == 2
    b.output(halves[1], "right")
    b.output(parts[2], "last")
    b.output(thirds[0], "top")
    with pytest.raises(GraphError, match=r"Split: its number of outputs varies per node; pass outputs=N"):
        b.op("Split", x, axis=1)
    g = b.build()
    x_val = np.arange(12, dtype=np.float32).reshape(2, 6)
    for graph in (g, geir.from_onnx(geir.to_onnx(g))):
        out = geir.run(graph, {"x": x_val}, runtime=runtime)
        np.testing.assert_array_equal(out["right"], x_val[:, 3:])
        np.testing.assert_array_equal(out["last"], x_val[:, 3:])
        np.testing.assert_array_equal(out["top"], x_val[:1])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_huge_sparse_block_size_costs_only_the_keys_that_exist(runtime):
    case = AttentionCase(B=1, S1=4, S2=9, N1=2, K=2, bs=16, mode=0)
    arrays = case.arrays()
    indices = np.full(arrays["sparse_indices"].shape, -1, np.int32)
    indices[..., 0] = 0                        # block 0 covers every key when bs >= S2
    arrays["sparse_indices"] = indices
    want = None
    for bs in (16, 2**40):
        attrs = dict(case.forward_attrs(), sparse_block_size=bs)
        g, feeds = sfa_graph(arrays, SFA, **attrs)
        start = time.perf_counter()
        out = geir.run(g, feeds, runtime=runtime)
        assert time.perf_counter() - start < 30    # 2**40 candidates would need terabytes
        want = out if want is None else want
        for name in out:
            np.testing.assert_array_equal(out[name], want[name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", geir.GeirWarning)
            for target in ("ascend910b", "ascend910_93", "ascend950"):
                report = geir.check(g, target=target)
                if bs == 2**40:
                    assert "SA-T7" in report.rules()


def test_an_empty_grad_slice_warns_at_build_and_at_check():
    with pytest.warns(geir.GeirWarning, match=r"\[RP-W1\] InplacePartialRotaryMulGrad 'node': attribute "
                                              r"'partial_slice': expected a non-empty slice .* got \[0, 0\]"):
        g = rotary_graph(ROPE_GRAD, (1, 1, 1, 8), (1, 1, 1, 8), rotary_mode=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = [geir.check(g, target=t) for t in ("ascend910b", "ascend910_93", "ascend950")]
    assert any("[RP-W1]" in str(w.message) for w in caught)
    for report in reports:
        assert any(w.rule == "RP-W1" for w in report.warnings), str(report)
    assert reports[2].ok                     # a warning, not a violation: CANN's code runs it as the identity
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rotary_graph(ROPE_GRAD, (1, 1, 1, 8), (1, 1, 1, 8), rotary_mode=1, partial_slice=[0, 8])   # no warning
