"""Random valid inputs for the sparse flash-attention ops, built from the spec's definitions."""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from .sfa import batches

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64, "float32": np.float32}


@dataclass
class SfaCase:
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

    def arrays(self) -> dict[str, np.ndarray | None]:
        rng = np.random.default_rng(self.seed)
        dt = NP[self.dtype]
        bsnd = self.layout == "BSND"
        qlead = (self.B, self.S1) if bsnd else (self.tnd_q[-1] + 1,)       # TND: one trailing unbatched row
        kvlead = (self.B, self.S2) if bsnd else (self.tnd_kv[-1] + 2,)
        a = lambda *shape: (rng.standard_normal(shape)).astype(dt)  # noqa: E731
        arrays: dict[str, np.ndarray | None] = {
            "query": a(*qlead, self.N1, self.D), "key": a(*kvlead, self.N2, self.D),
            "value": None if self.kv_merge else a(*kvlead, self.N2, self.D2),
            "query_rope": a(*qlead, self.N1, self.Dr) if self.Dr else None,
            "key_rope": a(*kvlead, self.N2, self.Dr) if self.Dr else None,
            "sinks": rng.standard_normal(self.N1).astype(np.float32) if self.sinks else None,
        }
        if bsnd:
            aq = rng.integers(0, self.S1 + 1, self.B).astype(np.int32) if self.lengths else None
            akv = rng.integers(0, self.S2 + 1, self.B).astype(np.int32) if self.lengths else None
        else:
            aq, akv = np.array(self.tnd_q, np.int32), np.array(self.tnd_kv, np.int32)
        arrays["actual_seq_lengths_query"], arrays["actual_seq_lengths_kv"] = aq, akv
        indices = np.full(qlead + (self.N2, self.K), 10**6, np.int32)   # rows never read keep garbage
        for _, s1b, s2b, qrow, _, _ in batches(self.layout, arrays["query"].shape, arrays["key"].shape, aq, akv, True):
            blocks = -(-s2b // self.bs)
            for s1 in range(s1b):
                thr = s2b if self.mode == 0 else s2b - s1b + s1 + 1
                for n2 in range(self.N2):
                    row = np.full(self.K, -1, np.int32)
                    if thr > 0 and blocks > 0:
                        count = rng.integers(0, min(self.K, blocks) + 1)
                        row[:count] = rng.choice(blocks, count, replace=False)
                    if thr > 0 or rng.random() < 0.5:
                        indices[qrow(s1) + (n2,)] = row
        arrays["sparse_indices"] = indices
        return arrays

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
