"""What the tests of every family share: dtype names, random and awkward feeds, graph comparison, the pieces of the
subgraphs exporters write (int64 constants, Slice), the check that a rewrite computes what the original did and
the one that a VJP agrees with finite differences. Each family's own builders and cases are in
tests/<family>/helpers.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import geir
from geir.testing import reference

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64, "float32": np.float32}


def random_feeds(graph: geir.Graph, seed: int = 0, bindings: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Standard-normal feeds for every graph input; symbolic dims take their size from ``bindings``."""
    rng = np.random.default_rng(seed)
    sizes = bindings or {}
    return {v.name: rng.standard_normal([sizes[d] if isinstance(d, str) else d for d in v.shape]).astype(v.dtype.numpy)
            for v in graph.inputs}


def awkward_values(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Normals with NaNs of both signs and several payloads (quiet and signalling), infinities, signed zeros,
    subnormals and values near the dtype's maximum (which overflow when weighted by |w| > 1)."""
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    bits = x.view(np.uint16 if x.itemsize == 2 else np.uint32).reshape(-1)
    info = ml_dtypes.finfo(dtype)
    specials = np.array([np.inf, -np.inf, 0.0, -0.0, info.max, -info.max, info.smallest_subnormal], dtype)
    picks = rng.choice(bits.size, 4 * len(specials) + 8, replace=False)
    x.reshape(-1)[picks[:4 * len(specials)]] = np.repeat(specials, 4)
    payloads = {2: [0x7fc1, 0xffc0, 0x7f81, 0xff90], 4: [0x7fc00001, 0xffc00000, 0x7f800001, 0xff900000]}[x.itemsize]
    if x.dtype == np.float16:
        payloads = [0x7e01, 0xfe00, 0x7c01, 0xfc90]
    bits[picks[-8:]] = np.repeat(np.array(payloads, bits.dtype), 2)
    return x


BIG = 2 ** 62
"""An end past any axis (Slice clamps it): what exporters write for "to the end"."""


def ints(b: geir.GraphBuilder, values, name: str | None = None) -> geir.Value:
    """An int64 constant (named ``name``, else c1, c2, ... in the order made)."""
    if name is None:
        ints.count = getattr(ints, "count", 0) + 1
        name = f"c{ints.count}"
    return b.constant(name, np.asarray(values, np.int64))


def onnx_slice(b: geir.GraphBuilder, x: geir.Value, start: int, end: int, step: int = 1, axis: int = -1) -> geir.Value:
    """ONNX Slice of ``x`` along one axis, its bounds as constants."""
    return b.op("Slice", x, ints(b, [start]), ints(b, [end]), ints(b, [axis]), ints(b, [step]))


def assert_same_function(original: geir.Graph, fused: geir.Graph, runtimes=("numpy", "onnxruntime")) -> None:
    """A rewritten graph (``geir.fuse``) computes what the original did: same interface, the float64 reference
    within 1e-12 on random data (integer inputs: permutations), each runtime within 2e-6."""
    assert [(v.name, str(v.type)) for v in fused.inputs] == [(v.name, str(v.type)) for v in original.inputs]
    assert [(v.name, str(v.type)) for v in fused.outputs] == [(v.name, str(v.type)) for v in original.outputs]
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.standard_normal(v.type.shape).astype(v.dtype.numpy) for v in original.inputs
             if v.dtype.is_floating}
    feeds.update({v.name: rng.permutation(v.type.shape[0]).astype(v.dtype.numpy) for v in original.inputs
                  if not v.dtype.is_floating})
    want, got = reference(original, feeds, rounded=False), reference(fused, feeds, rounded=False)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12)
    for runtime in runtimes:
        a, b = geir.run(original, feeds, runtime=runtime), geir.run(fused, feeds, runtime=runtime)
        for name in a:
            np.testing.assert_allclose(b[name].astype(np.float64), a[name].astype(np.float64), rtol=2e-6, atol=2e-6)


EPS = 1e-6
"""The finite differences' step (float64 references)."""


def directional_error(graph: geir.Graph, feeds: dict, wrt=None, seed: int = 0) -> float:
    """Relative distance between the VJP's and the finite differences' directional derivative (``geir.grad``
    against central differences of the float64 reference, along a random direction and cotangent; outputs of
    symbolic shape too)."""
    rng = np.random.default_rng(seed)
    derivative = geir.grad(graph, wrt=wrt)
    names = [v.name for v in graph.inputs if v.dtype.is_floating and (wrt is None or v.name in wrt)]
    outputs = [v for v in graph.outputs if v.dtype.is_floating]
    # the cotangent inputs follow the forward inputs, one per output in order (grad_<output>, or another name where
    # that one is taken: a pass-through output)
    cotangent_names = [v.name for v in derivative.inputs[len(graph.inputs):]]
    assert len(cotangent_names) == len(outputs)
    base = {k: (a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a)
            for k, a in feeds.items()}
    # an output of symbolic shape gets a cotangent of the shape a run gives it
    shapes = {v.name: v.type.shape for v in outputs} if all(v.type.is_static for v in outputs) else \
        {name: np.shape(array) for name, array in reference(graph, base, rounded=False).items()}
    cotangents = {name: rng.standard_normal(shapes[v.name]) for name, v in zip(cotangent_names, outputs)}
    got = reference(derivative, {**base, **cotangents}, rounded=False)
    direction = {k: rng.standard_normal(base[k].shape) for k in names}
    shifted = [reference(graph, {**base, **{k: base[k] + sign * EPS * direction[k] for k in names}}, rounded=False)
               for sign in (1, -1)]
    fd = sum(np.sum(cotangents[name] * (shifted[0][v.name] - shifted[1][v.name]))
             for name, v in zip(cotangent_names, outputs)) / (2 * EPS)
    analytic = sum(np.sum(got[f"grad_{k}"] * direction[k]) for k in names)
    return abs(fd - analytic) / max(abs(fd), 1e-12)


def uniform_feeds(graph: geir.Graph, seed: int = 1) -> dict:
    """Feeds in [0.5, 1.5) for every graph input (away from zero, for finite differences)."""
    rng = np.random.default_rng(seed)
    return {v.name: rng.uniform(0.5, 1.5, v.type.shape).astype(v.dtype.numpy) for v in graph.inputs}


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


def assert_rule_error(build, rule: str, *facts: str, op: str, node: str = "node", built_at: str | None = None) -> None:
    """``build()`` raises the GraphError of ``rule`` at ``op`` '``node``', naming every fact (and where the node was
    built, when ``built_at`` is given)."""
    with pytest.raises(geir.GraphError) as err:
        build()
    message = str(err.value)
    assert err.value.rule == rule and message.startswith(f"[{rule}] {op} '{node}': "), message
    for fact in facts:
        assert fact in message, (fact, message)
    if built_at is not None:
        assert f"node built at {built_at}" in message, message
