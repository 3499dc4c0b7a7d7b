"""The sparse attention ops' example cases: the worked example E1 (spec 4.9), exact in float16 and
bfloat16, and ``SfaCase``, random valid inputs of any shape and mode, which the benchmarks (``BENCH``)
and ``geir example`` draw from (the tests have their own, tests/sparse_attention/helpers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...ir._dtypes import as_dtype
from .._examples import Example, register_examples
from .schema import FORWARD, GRAD
from .selection import query_rows

HALF = ("float16", "bfloat16")
STATS_F32 = {dt: {"softmax_max": "float32", "softmax_sum": "float32"} for dt in HALF}

# BSND B=1, S1=1, S2=4, N1=2, N2=1, D=D2=4, K=4, bs=1, mode 0, scale 0.5: both selected scores are 2
E1_QUERY = np.ones((1, 1, 2, 4))
E1_KEY = np.array([[1.0] * 4, [2.0] * 4, [2.0, 0, 1, 1], [4.0] * 4]).reshape(1, 4, 1, 4)
E1_VALUE = np.repeat(np.arange(1.0, 5.0), 4).reshape(1, 4, 1, 4)
E1_INDICES = np.array([0, 2, -1, -1], np.int32).reshape(1, 1, 1, 4)
E1_ATTRS = {"scale_value": 0.5, "sparse_mode": 0}
E1_OUT = np.full((1, 1, 2, 4), 2.0)
E1_STATS = np.full((1, 1, 1, 2), 2.0)

register_examples(
    Example("E1 forward (4.9)", FORWARD, {"query": E1_QUERY, "key": E1_KEY, "value": E1_VALUE,
                                          "sparse_indices": E1_INDICES},
            {**E1_ATTRS, "return_softmax_lse": True},
            {"attention_out": E1_OUT, "softmax_max": E1_STATS, "softmax_sum": E1_STATS}, HALF),
    Example("E1 grad (4.9)", GRAD, {"query": E1_QUERY, "key": E1_KEY, "sparse_indices": E1_INDICES,
                                    "d_out": np.ones((1, 1, 2, 4)), "out": E1_OUT, "softmax_max": E1_STATS,
                                    "softmax_sum": E1_STATS, "value": E1_VALUE},
            E1_ATTRS,
            {"d_query": np.tile([1.0, -1, 0, 0], (1, 1, 2, 1)),
             "d_key": np.array([[-2.0] * 4, [0.0] * 4, [2.0] * 4, [0.0] * 4]).reshape(1, 4, 1, 4),
             "d_value": np.array([[1.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4]).reshape(1, 4, 1, 4)},
            HALF, STATS_F32),
)


@dataclass
class SfaCase:
    """Random inputs of one shape and mode that satisfy every rule of spec 4.3-4.5.

    Each read row selects a random number of distinct blocks (``full``: exactly K, when there are
    that many) in random order, padded with -1; some rows that are never read (empty threshold)
    keep garbage ids, which the op must ignore. BSND takes per-batch lengths when ``lengths``;
    TND always has cumulative lengths, and one trailing query row outside every batch.
    """

    layout: str = "BSND"
    B: int = 2
    S1: int = 5
    S2: int = 9
    N1: int = 4
    N2: int = 1
    D: int = 8
    D2: int = 8
    Dr: int = 0
    K: int = 4
    bs: int = 1
    mode: int = 3
    kv_merge: bool = False
    sinks: bool = False
    lengths: bool = False          # BSND: per-batch lengths (forward); TND always has them
    dtype: str = "float16"
    seed: int = 0
    tnd_q: list[int] = field(default_factory=lambda: [3, 5])    # TND cumulative lengths
    tnd_kv: list[int] = field(default_factory=lambda: [4, 9])
    scale_value: float | None = None   # default: float32(1 / sqrt(D + Dr))
    full: bool = False

    def arrays(self) -> dict[str, np.ndarray | None]:
        rng = np.random.default_rng(self.seed)
        dt = as_dtype(self.dtype).numpy
        bsnd = self.layout == "BSND"
        qlead = (self.B, self.S1) if bsnd else (self.tnd_q[-1] + 1,)       # TND: one trailing unbatched row
        kvlead = (self.B, self.S2) if bsnd else (self.tnd_kv[-1] + 2,)

        def normal(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape).astype(dt)

        arrays: dict[str, np.ndarray | None] = {
            "query": normal(*qlead, self.N1, self.D), "key": normal(*kvlead, self.N2, self.D),
            "value": None if self.kv_merge else normal(*kvlead, self.N2, self.D2),
            "query_rope": normal(*qlead, self.N1, self.Dr) if self.Dr else None,
            "key_rope": normal(*kvlead, self.N2, self.Dr) if self.Dr else None,
            "sinks": rng.standard_normal(self.N1).astype(np.float32) if self.sinks else None,
        }
        if bsnd:
            aq = rng.integers(0, self.S1 + 1, self.B).astype(np.int32) if self.lengths else None
            akv = rng.integers(0, self.S2 + 1, self.B).astype(np.int32) if self.lengths else None
        else:
            aq, akv = np.array(self.tnd_q, np.int32), np.array(self.tnd_kv, np.int32)
        arrays["actual_seq_lengths_query"], arrays["actual_seq_lengths_kv"] = aq, akv
        arrays["sparse_indices"] = self._indices(rng, qlead, aq, akv)
        return arrays

    def _indices(self, rng: np.random.Generator, qlead: tuple[int, ...], aq: np.ndarray | None,
                 akv: np.ndarray | None) -> np.ndarray:
        rows = query_rows(self.layout, int(np.prod(qlead)), self.S1, self.S2, aq, akv, self.mode)
        indices = np.full((rows.s1.size, self.N2, self.K), 10**6, np.int32)   # rows never read keep garbage
        for r in np.flatnonzero(rows.active):                                  # test data, not a hot path
            blocks, thr = -(-int(rows.s2_len[r]) // self.bs), int(rows.threshold[r])
            for n2 in range(self.N2):
                row = np.full(self.K, -1, np.int32)
                if thr > 0 and blocks > 0:
                    count = min(self.K, blocks) if self.full else rng.integers(0, min(self.K, blocks) + 1)
                    row[:count] = rng.choice(blocks, count, replace=False)
                if thr > 0 or rng.random() < 0.5:
                    indices[r, n2] = row
        return indices.reshape(qlead + (self.N2, self.K))

    @property
    def scale(self) -> float:
        if self.scale_value is not None:
            return self.scale_value
        return float(np.float32(1 / np.sqrt(self.D + self.Dr)))

    def forward_attrs(self) -> dict:
        return dict(scale_value=self.scale, sparse_block_size=self.bs, layout_query=self.layout,
                    layout_kv=self.layout, sparse_mode=self.mode, return_softmax_lse=True)

    def grad_attrs(self) -> dict:
        return dict(scale_value=self.scale, sparse_block_size=self.bs, layout=self.layout, sparse_mode=self.mode)


BENCH = {"quick": SfaCase(B=1, S1=64, S2=512, N1=16, D=128, D2=128, Dr=64, K=64, mode=0, full=True),
         "bench": SfaCase(B=1, S1=512, S2=2048, N1=16, D=128, D2=128, Dr=64, K=256, mode=0, full=True),
         "cann": SfaCase(B=1, S1=64, S2=4096, N1=128, D=512, D2=512, Dr=64, K=2048, bs=1, mode=3, full=True,
                         dtype="bfloat16")}
"""Benchmark shapes of ``geir bench`` (``--quick``, full, and the CANN-sized shape of issue 13): every row sees
K distinct keys (mode 3 rows near the start see fewer: the causal bound)."""
