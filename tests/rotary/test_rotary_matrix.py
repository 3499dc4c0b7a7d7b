"""A CANN-style case matrix, as a user's suite runs one (and as pytest-xdist spreads it, README "Spreading a test
matrix"): both rotary ops x every legal dtype pair x the four rotary modes x the six targets x both runtimes
(geir's ``geir_runtime`` fixture; ``--geir-runtime`` narrows it), 672 cases. Each case checks the graph against the
target, expecting the rule IDs of the spec's target table (2.3) as stated here, and runs it against the float64
oracle. Its data follow from the case's own parameters, so a case draws the same numbers alone, in the whole
matrix, or on any worker."""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

import geir
from geir.schemas.targets import TARGETS
from oracles.numerics import assert_matches_reference
from oracles.rotary import rotary_reference
from rotary.helpers import ROPE, ROPE_GRAD, rotary_graph

pytestmark = pytest.mark.slow   # 672 cases: 31-36 s on two cores in one process, 24-27 s with pytest -n 2

FORWARD_PAIRS = [("float16", "float16"), ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"),
                 ("bfloat16", "float32")]
GRAD_PAIRS = [(d, c) for d in ("float16", "float32", "bfloat16") for c in ("float16", "float32", "bfloat16")]
CASES = [(ROPE, d, c) for d, c in FORWARD_PAIRS] + [(ROPE_GRAD, d, c) for d, c in GRAD_PAIRS]
SHAPE, TABLE, SLICE = (2, 128, 8, 128), (2, 128, 1, 64), (32, 96)
"""(B, S, N, D) as CANN's tables size a head (D = 128, the rope on half of it), with a (B, S, 1, L) table: the
layout every target's forward takes (RP-T5)."""
TRAINING = ("ascend910b", "ascend910_93", "ascend950")


def expected_rules(op: str, mode: int, target: str) -> set[str]:
    """Spec 2.3: the forward has a kernel on the three training targets, the grad on ascend950 only (RP-T1);
    where there is a kernel, only mode 1 (interleave) runs (RP-T2)."""
    with_kernel = TRAINING if op == ROPE else ("ascend950",)
    if target not in with_kernel:
        return {"RP-T1"}
    return set() if mode == 1 else {"RP-T2"}


@functools.cache
def _graph(op: str, dtype: str, table_dtype: str, mode: int) -> geir.Graph:
    """One graph per op, dtypes and mode, shared by its targets and runtimes (compiled once per runtime, as a
    user's matrix reuses a graph)."""
    return rotary_graph(op, SHAPE, TABLE, dtype, table_dtype, rotary_mode=mode, partial_slice=list(SLICE))


def _feeds(op: str, dtype: str, table_dtype: str, mode: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(f"{op}-{dtype}-{table_dtype}-{mode}".encode()))
    x = rng.standard_normal(SHAPE).astype(geir.as_dtype(dtype).numpy)
    cos, sin = (rng.uniform(-1, 1, TABLE).astype(geir.as_dtype(table_dtype).numpy) for _ in range(2))
    return {"x": x, "cos": cos, "sin": sin}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("op, dtype, table_dtype", CASES)
def test_case(geir_runtime, op, dtype, table_dtype, mode, target):
    graph = _graph(op, dtype, table_dtype, mode)
    assert geir.check(graph, target=target).rules() == expected_rules(op, mode, target)
    feeds = _feeds(op, dtype, table_dtype, mode)
    got = geir.run(graph, feeds, runtime=geir_runtime)["y"]
    want, magnitude = rotary_reference(feeds["x"], feeds["cos"], feeds["sin"], mode, *SLICE, op == ROPE_GRAD)
    assert got.dtype == feeds["x"].dtype
    assert_matches_reference(got, want, magnitude, f"{op} {dtype}/{table_dtype} mode {mode} on {geir_runtime}")
