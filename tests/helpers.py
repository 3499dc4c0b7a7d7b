"""Small graph-building helpers shared by the tests."""

from __future__ import annotations

import numpy as np

import geir

ROPE, ROPE_GRAD = "InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"


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
