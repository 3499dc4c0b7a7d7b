"""``help()`` tells the truth (issue 30 item 7): what the builder method, the ``ge.op`` class and the aclnn call say
an op returns is what they return. SparseFlashAttention without return_softmax_lse returns float32 ``(0,)``
statistics, not None (its help used to say None for every multi-output op); only an optional output may be absent
(None from the builder), as the grad's d_value and rope gradients; MoeTokenUnpermuteGrad without probs returns zeros.
Each test reads the help text and runs the call, so the two cannot drift apart. geir.torch's help:
tests/torch_frontend/test_torch_documented_results.py."""

from __future__ import annotations

import numpy as np
import pytest

import geir
from geir import aclnn, ge
from geir.ir._registry import all_schemas
from aclnn.helpers import two_phase
from sparse_attention.helpers import SFA, SFA_GRAD, AttentionCase

RUNTIMES = geir.runtimes.runtime_names()


def _said(text: str) -> str:
    """Help text with its line breaks and indentation as single spaces (a claim may wrap)."""
    return " ".join(text.split())


def _returns(op_type: str) -> list[str]:
    """The lines of the builder method's ``Returns:`` section."""
    doc = getattr(geir.GraphBuilder("probe"), op_type).__doc__
    return [line.strip() for line in doc[doc.index("Returns:"):].splitlines()[1:]]


@pytest.mark.parametrize("schema", all_schemas(), ids=lambda s: s.op_type)
def test_help_says_none_exactly_for_the_optional_outputs_and_names_each_output(schema):
    lines = _returns(schema.op_type)
    optional = [s.name for s in schema.outputs if s.optional]
    described = lines[1:] if len(schema.outputs) > 1 else lines
    assert len(described) == len(schema.outputs)
    for line, spec in zip(described, schema.outputs):
        assert line.split(" ")[0].rstrip(":") == spec.name and line.endswith(spec.doc)
        assert ("(optional: None when absent)" in line) == spec.optional
    if len(schema.outputs) > 1:
        assert lines[0].startswith("a tuple in GE IR order of a Value per output")
        assert lines[0].endswith(f"None for an absent optional one ({', '.join(optional)}):" if optional
                                 else "never None:")
    assert ("None" in "\n".join(described)) == bool(optional)     # an output said to be None may be None
    ge_doc = getattr(ge.op, schema.op_type).__doc__
    assert "None" not in ge_doc and all(f"{spec.name}{' (optional)' if spec.optional else ''}" in ge_doc
                                        for spec in schema.outputs)


def _attention(case: AttentionCase, lse: bool):
    arrays = {k: v for k, v in case.arrays().items() if v is not None}
    b = geir.GraphBuilder("sfa")
    results = b.SparseFlashAttention(**{k: b.input(k, v.dtype, v.shape) for k, v in arrays.items()},
                                     **{**case.forward_attrs(), "return_softmax_lse": lse})
    return b, results, arrays


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("lse", [False, True])
def test_attention_statistics_are_what_help_says(lse, layout, runtime):
    case = AttentionCase(layout=layout, N1=4, N2=2, seed=3)
    b, results, arrays = _attention(case, lse)
    assert len(results) == 3 and all(isinstance(v, geir.Value) for v in results)       # never None
    for name, value in zip(("attention_out", "softmax_max", "softmax_sum"), results):
        b.output(value, name)
    got = geir.run(b.build(), arrays, runtime=runtime)
    g = case.N1 // case.N2
    rows = (case.B, case.N2, case.S1, g) if layout == "BSND" else (case.N2, arrays["query"].shape[0], g)
    for name in ("softmax_max", "softmax_sum"):
        assert got[name].dtype == np.float32 and got[name].shape == (rows if lse else (0,)), name
    assert got["attention_out"].shape == arrays["query"].shape

    lines = _returns(SFA)
    assert lines[0].endswith("never None:")
    assert lines[2] == "softmax_max: float32 (B, N2, S1, G) / (N2, T1, G), or (0,) without return_softmax_lse"
    assert lines[3] == "softmax_sum: same shape as softmax_max"
    assert "or (0,) without return_softmax_lse" in ge.op.SparseFlashAttention.__doc__


def test_the_grads_absent_outputs_are_none_as_help_says():
    """Without the rope inputs and value (a KV merge) the grad's d_value and rope gradients are absent: None."""
    case = AttentionCase(N1=4, N2=1, D=8, D2=8, seed=4)
    arrays = case.arrays()
    b = geir.GraphBuilder("grad")
    q, k = (b.input(n, arrays[n].dtype, arrays[n].shape) for n in ("query", "key"))
    indices = b.input("sparse_indices", arrays["sparse_indices"].dtype, arrays["sparse_indices"].shape)
    stats = (case.B, case.N2, case.S1, case.N1 // case.N2)
    d_out, out = (b.input(n, arrays["query"].dtype, arrays["query"].shape) for n in ("d_out", "out"))
    row_max, row_sum = (b.input(n, "float32", stats) for n in ("softmax_max", "softmax_sum"))
    results = b.SparseFlashAttentionGrad(q, k, indices, d_out, out, row_max, row_sum, **case.grad_attrs())
    absent = [spec.name for spec, value in zip(geir.schemas.get_schema(SFA_GRAD).outputs, results) if value is None]
    assert absent == ["d_value", "d_query_rope", "d_key_rope"]
    lines = _returns(SFA_GRAD)
    assert lines[0].endswith("None for an absent optional one (d_value, d_query_rope, d_key_rope):")
    assert [line.split(" ")[0] for line in lines if "(optional: None when absent)" in line] == absent


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_unpermute_grad_without_probs_returns_zeros_as_help_says(runtime):
    b = geir.GraphBuilder("moe_grad")
    tokens, dy = b.input("tokens", "float16", (6, 8)), b.input("dy", "float16", (6, 8))
    indices = b.input("indices", "int32", (6,))
    rows, weights = b.MoeTokenUnpermuteGrad(tokens, dy, indices)
    assert isinstance(weights, geir.Value)
    b.output(rows, "rows")
    b.output(weights, "weights")
    feeds = {"tokens": np.ones((6, 8), np.float16), "dy": np.ones((6, 8), np.float16),
             "indices": np.arange(6, dtype=np.int32)[::-1].copy()}
    got = geir.run(b.build(), feeds, runtime=runtime)["weights"]
    assert got.dtype == np.float16 and got.shape == (6, 1) and not got.any()
    assert _returns("MoeTokenUnpermuteGrad")[2] == ("probs_grad: shape of probs; without probs zeros (tokens, 1) of "
                                                    "the token dtype")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_ge_graph_returns_the_empty_statistics_its_help_names(runtime):
    case = AttentionCase(seed=5)
    arrays = {k: v for k, v in case.arrays().items() if v is not None}
    assert ge.GEInitialize({"ge.exec.deviceId": "0", "ge.graphRunMode": "1"}) == ge.SUCCESS
    try:
        graph, data, tensors = ge.Graph("sfa"), [], []
        kinds = {np.dtype(np.float16): ge.DT_FLOAT16, np.dtype(np.int32): ge.DT_INT32}
        node = ge.op.SparseFlashAttention("sfa")
        for index, (name, array) in enumerate(arrays.items()):
            desc = ge.TensorDesc(ge.Shape(list(array.shape)), ge.FORMAT_ND, kinds[array.dtype])
            op = ge.op.Data(name).set_attr_index(index).update_output_desc_y(desc)
            getattr(node, f"set_input_{name}")(op)
            data.append(op)
            tensors.append(ge.Tensor(desc, array))
        node.set_attr_scale_value(case.scale).set_attr_sparse_mode(case.mode)      # return_softmax_lse: False
        graph.SetInputs(data).SetOutputs([(node, ["attention_out", "softmax_max", "softmax_sum"])])
        session = ge.Session({"geir.runtime": runtime})
        outputs: list[ge.Tensor] = []
        assert session.AddGraph(0, graph) == ge.SUCCESS and session.RunGraph(0, tensors, outputs) == ge.SUCCESS
    finally:
        ge.GEFinalize()
    assert len(outputs) == 3
    for tensor in outputs[1:]:
        assert tensor.GetData().dtype == np.float32 and tensor.GetData().shape == (0,)
        assert tensor.GetTensorDesc().GetShape().GetDims() == [0]
    assert "softmax_max: float32 (B, N2, S1, G) / (N2, T1, G), or (0,) without return_softmax_lse" in \
        ge.op.SparseFlashAttention.__doc__


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_aclnn_writes_no_statistics_without_return_softmax_lse_as_its_help_says(runtime):
    case = AttentionCase(seed=6)
    a = case.arrays()
    t = aclnn.aclCreateTensor
    assert aclnn.aclInit(None, runtime=runtime) == aclnn.ACLNN_SUCCESS
    try:
        head = (t(a["query"]), t(a["key"]), t(a["value"]), t(a["sparse_indices"]), None, None, None, None, None)
        tail = (case.scale, case.bs, "BSND", "BSND", case.mode, 2**63 - 1, 2**63 - 1, 0, False)
        out = np.zeros(a["query"].shape, a["query"].dtype)
        kept = np.full((case.B, case.N2, case.S1, case.N1 // case.N2), 7.0, np.float32)
        assert two_phase(aclnn.aclnnSparseFlashAttentionGetWorkspaceSize, aclnn.aclnnSparseFlashAttention,
                         *head, *tail, t(out), None, None) == 0                       # null statistics: fine
        assert out.any()
        assert two_phase(aclnn.aclnnSparseFlashAttentionGetWorkspaceSize, aclnn.aclnnSparseFlashAttention,
                         *head, *tail, t(out), t(kept), t(kept.copy())) == 0
        assert np.all(kept == 7.0)                                                    # given ones: not written
        v2_head = (*head, None)
        assert two_phase(aclnn.aclnnSparseFlashAttentionV2GetWorkspaceSize, aclnn.aclnnSparseFlashAttentionV2,
                         *v2_head, *tail, t(out), None, None) == aclnn.ACLNN_ERR_PARAM_NULLPTR
    finally:
        aclnn.aclFinalize()
    said = _said(aclnn.aclnnSparseFlashAttentionGetWorkspaceSize.__doc__)
    assert "With it false the statistics are not computed: they may be null (None), and tensors given there are " \
           "not written" in said
    assert "must be tensors even when ``returnSoftmaxLse`` is false (null is 161001)" in \
        _said(aclnn.aclnnSparseFlashAttentionV2GetWorkspaceSize.__doc__)
