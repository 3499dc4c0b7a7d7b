"""Small graph-building helpers shared by the tests."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import geir

ROPE, ROPE_GRAD = "InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64, "float32": np.float32}

empty_grad_slices_expected = pytest.mark.filterwarnings(r"ignore:\[RP-W1\]:geir.GeirWarning")
"""For tests that build rotary grads with an empty slice on purpose (the RP-W1 warning has its own test)."""


def rotary_graph(op: str, x_shape, cos_shape, dtype="float32", cos_dtype=None, name: str = "node", **attrs):
    """A one-node rotary graph with inputs x, cos, sin and output y."""
    b = geir.GraphBuilder("g")
    x = b.input("x", dtype, x_shape)
    cos = b.input("cos", cos_dtype or dtype, cos_shape)
    sin = b.input("sin", cos_dtype or dtype, cos_shape)
    b.output(getattr(b, op)(x, cos, sin, name=name, **attrs), "y")
    return b.build()


def random_feeds(graph: geir.Graph, seed: int = 0, bindings: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Standard-normal feeds for every graph input; symbolic dims take their size from ``bindings``."""
    rng = np.random.default_rng(seed)
    sizes = bindings or {}
    return {v.name: rng.standard_normal([sizes[d] if isinstance(d, str) else d for d in v.shape]).astype(v.dtype.numpy)
            for v in graph.inputs}


MOE, MOE_GRAD = "MoeTokenUnpermute", "MoeTokenUnpermuteGrad"


def moe_graph(rows, hidden, slots, probs_shape=None, dtype="float32", probs_dtype=None, name="node", **attrs):
    """One MoeTokenUnpermute node: inputs tokens, indices[, probs]; output y."""
    b = geir.GraphBuilder("moe")
    tokens = b.input("tokens", dtype, (rows, hidden))
    indices = b.input("indices", "int32", (slots,))
    probs = b.input("probs", probs_dtype or dtype, probs_shape) if probs_shape is not None else None
    b.output(b.MoeTokenUnpermute(tokens, indices, probs, name=name, **attrs), "y")
    return b.build()


def moe_grad_graph(tokens_shape, grad_shape, slots, probs_shape=None, dtype="float32", probs_dtype=None,
                   name="node", index_dtype="int32", **attrs):
    """One MoeTokenUnpermuteGrad node: inputs [tokens,] dy, indices[, probs]; outputs ptg, pg."""
    b = geir.GraphBuilder("moe_grad")
    tokens = b.input("tokens", dtype, tokens_shape) if tokens_shape is not None else None
    dy = b.input("dy", dtype, grad_shape)
    indices = b.input("indices", index_dtype, (slots,))
    probs = b.input("probs", probs_dtype or dtype, probs_shape) if probs_shape is not None else None
    ptg, pg = b.MoeTokenUnpermuteGrad(tokens, dy, indices, probs, name=name, **attrs)
    b.output(ptg, "ptg")
    b.output(pg, "pg")
    return b.build()


SFA, SFA_GRAD = "SparseFlashAttention", "SparseFlashAttentionGrad"
FWD_INPUTS = ("query", "key", "value", "sparse_indices", "block_table", "actual_seq_lengths_query",
              "actual_seq_lengths_kv", "query_rope", "key_rope", "sinks")
GRAD_INPUTS = ("query", "key", "sparse_indices", "d_out", "out", "softmax_max", "softmax_sum", "value",
               "actual_seq_lengths_query", "actual_seq_lengths_kv", "query_rope", "key_rope")


def sfa_graph(feeds: dict, op: str = SFA, name: str = "node", **attrs):
    """One sparse attention node over the non-None arrays of ``feeds`` (keyed by GE IR input name).

    Returns ``(graph, feeds)`` with the graph inputs named like the op inputs and outputs named
    like the op outputs (absent optional outputs are not graph outputs).
    """
    from geir.schemas import get_schema
    schema = get_schema(op)
    b = geir.GraphBuilder(op.lower())
    values = {k: b.input(k, np.asarray(v).dtype, np.shape(v)) for k, v in feeds.items() if v is not None}
    results = getattr(b, op)(**values, name=name, **attrs)
    for spec, value in zip(schema.outputs, results):
        if value is not None:
            b.output(value, spec.name)
    return b.build(), {k: v for k, v in feeds.items() if v is not None}


def sfa_grad_feeds(arrays: dict, forward_out: dict, d_out: np.ndarray, layout: str, indices=None) -> dict:
    """SparseFlashAttentionGrad feeds from a forward case's arrays and its outputs (out and statistics); TND keeps
    its lengths, BSND drops them (the grad ignores them)."""
    feeds = {"query": arrays["query"], "key": arrays["key"],
             "sparse_indices": arrays["sparse_indices"] if indices is None else indices, "d_out": d_out,
             "out": forward_out["attention_out"], "softmax_max": forward_out["softmax_max"],
             "softmax_sum": forward_out["softmax_sum"], "value": arrays["value"], "query_rope": arrays["query_rope"],
             "key_rope": arrays["key_rope"]}
    if layout == "TND":
        feeds["actual_seq_lengths_query"] = arrays["actual_seq_lengths_query"]
        feeds["actual_seq_lengths_kv"] = arrays["actual_seq_lengths_kv"]
    return feeds


def assert_same_graph(got: geir.Graph, want: geir.Graph) -> None:
    """Same name, inputs, constants, nodes (op, domain, name, attributes, input and output names and types), outputs."""
    def sig(v):
        return None if v is None else (v.name, str(v.type))
    assert got.name == want.name
    assert [sig(v) for v in got.inputs] == [sig(v) for v in want.inputs]
    assert sorted(got.constants) == sorted(want.constants)
    for name, array in want.constants.items():
        assert got.constants[name].dtype == array.dtype and np.array_equal(got.constants[name], array), name
    assert len(got.nodes) == len(want.nodes)
    for a, b in zip(got.topological_order(), want.topological_order()):
        assert (a.op_type, a.domain, a.name) == (b.op_type, b.domain, b.name)
        assert a.attributes == b.attributes, (a.name, a.attributes, b.attributes)
        assert [sig(v) for v in a.inputs] == [sig(v) for v in b.inputs], a.name
        assert [sig(v) for v in a.outputs] == [sig(v) for v in b.outputs], a.name
    assert [sig(v) for v in got.outputs] == [sig(v) for v in want.outputs]
