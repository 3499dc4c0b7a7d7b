"""What the moe_permute family's tests share: op names, dtypes, one-node graph builders and random routings."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import geir

PERMUTE, PERMUTE_GRAD = "MoeTokenPermute", "MoeTokenPermuteGrad"
FLOATS = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOKEN_DTYPES = {**FLOATS, "int8": np.int8}


def permute_graph(tokens_shape, index_shape, dtype="float32", index_dtype="int32", name="node", **attrs) -> geir.Graph:
    """One MoeTokenPermute node: inputs tokens, indices; outputs rows, sorted."""
    b = geir.GraphBuilder("permute")
    tokens = b.input("tokens", dtype, tokens_shape)
    indices = b.input("indices", index_dtype, index_shape)
    rows, sorted_indices = b.MoeTokenPermute(tokens, indices, name=name, **attrs)
    b.output(rows, "rows")
    b.output(sorted_indices, "sorted")
    return b.build()


def permute_grad_graph(rows, hidden, slots, dtype="float32", name="node", **attrs) -> geir.Graph:
    """One MoeTokenPermuteGrad node: inputs grad (rows, hidden), sorted (slots,); output dx."""
    b = geir.GraphBuilder("permute_grad")
    grad = b.input("grad", dtype, (rows, hidden))
    sorted_indices = b.input("sorted", "int32", (slots,))
    b.output(b.MoeTokenPermuteGrad(grad, sorted_indices, name=name, **attrs), "dx")
    return b.build()


def routing(rng: np.random.Generator, tokens: int, topk: int, experts: int, dtype="int32", distinct=True) -> np.ndarray:
    """(tokens, topK) expert ids: distinct per token (top-K routing), or drawn with repeats (ties between slots)."""
    if distinct:
        return np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(dtype)
    return rng.integers(0, experts, (tokens, topk)).astype(dtype)


def random_tokens(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    if dtype == "int8":
        return rng.integers(-128, 128, shape).astype(np.int8)
    return rng.standard_normal(shape).astype(FLOATS[dtype])
