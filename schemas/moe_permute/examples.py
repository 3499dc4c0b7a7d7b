"""MoeTokenPermute(Grad)'s example cases: worked examples (exact in every dtype: the forward copies bits, the grad
adds small integers) and ``PermuteCase``, random routed inputs, whose ``BENCH`` instances ``geir bench`` measures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...ir._dtypes import as_dtype
from .._examples import Example, register_examples
from ..moe.indices import sorted_indices_from_expert_ids
from .schema import FORWARD, GRAD

ROUTING = np.array([[1, 2], [0, 1], [0, 2], [1, 2]], np.int32)
"""Spec 3.3's conventions example: 4 tokens, top-2 of 3 experts."""
ROW2SLOT = np.array([2, 4, 0, 3, 6, 1, 5, 7])
SORTED_INDICES = np.array([2, 5, 0, 3, 1, 6, 4, 7], np.int32)
TOKENS = np.arange(1.0, 13.0).reshape(4, 3)
FLOATS = ("float32", "float16", "bfloat16")
ALL = (*FLOATS, "int8")


def _examples() -> list[Example]:
    cann = np.repeat(np.array([[0.1], [0.2], [0.3]]), 4, axis=1)
    grad_rows = np.arange(1.0, 16.0).reshape(5, 3)
    kept = [[2], [0, 3], [1], [4]]                       # rows < 5 of each token's slots in SORTED_INDICES
    return [
        Example("spec 3.3 routing", FORWARD, {"tokens": TOKENS, "indices": ROUTING}, {},
                {"permute_tokens": TOKENS[ROW2SLOT // 2], "sorted_indices": SORTED_INDICES}, ALL),
        Example("CANN aclnn example", FORWARD, {"tokens": cann, "indices": np.array([[1, 2], [0, 1], [0, 2]], np.int32)},
                {}, {"permute_tokens": cann[[1, 2, 0, 1, 0, 2]], "sorted_indices": np.array([2, 4, 0, 3, 1, 5], np.int32)},
                FLOATS),
        Example("num_out_tokens = 5, int64 ids", FORWARD, {"tokens": TOKENS, "indices": ROUTING.astype(np.int64)},
                {"num_out_tokens": 5}, {"permute_tokens": TOKENS[ROW2SLOT[:5] // 2], "sorted_indices": SORTED_INDICES},
                ALL),
        Example("num_out_tokens = -3 (all but the last 3)", FORWARD, {"tokens": TOKENS, "indices": ROUTING},
                {"num_out_tokens": -3},
                {"permute_tokens": TOKENS[ROW2SLOT[:5] // 2], "sorted_indices": SORTED_INDICES}, ALL),
        Example("1-D indices (topK = 1)", FORWARD, {"tokens": TOKENS[:3], "indices": np.array([2, 0, 1], np.int64)}, {},
                {"permute_tokens": TOKENS[[1, 2, 0]], "sorted_indices": np.array([2, 0, 1], np.int32)}, ALL),
        Example("CANN aclnn grad example", GRAD, {"permuted_output_grad": np.array([[1.0, 2.0], [3.0, 4.0]]),
                                                  "sorted_indices": np.array([0, 1], np.int32)},
                {"num_topk": 2}, {"input_grad": np.array([[4.0, 6.0]])}, FLOATS),
        Example("dropped rows (R = 5 of 8)", GRAD, {"permuted_output_grad": grad_rows, "sorted_indices": SORTED_INDICES},
                {"num_topk": 2}, {"input_grad": np.array([grad_rows[r].sum(0) for r in kept])}, FLOATS),
    ]


register_examples(*_examples())


@dataclass(frozen=True)
class PermuteCase:
    """``tokens`` tokens each routed to ``topk`` distinct experts of ``experts`` (uniformly), hidden size ``hidden``:
    the forward's inputs (``op`` = MoeTokenPermute) or the grad's (``op`` = MoeTokenPermuteGrad)."""

    op: str
    tokens: int
    topk: int
    hidden: int
    dtype: str = "float32"
    experts: int = 64
    seed: int = 0

    @property
    def label(self) -> str:
        return f"T={self.tokens} K={self.topk} H={self.hidden} {self.dtype}"

    def expert_ids(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return np.argsort(rng.random((self.tokens, self.experts)), axis=1)[:, :self.topk].astype(np.int32)

    def arrays(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed + 1)
        dt = as_dtype(self.dtype).numpy
        ids = self.expert_ids()
        if self.op == FORWARD.op_type:
            return {"tokens": rng.standard_normal((self.tokens, self.hidden), np.float32).astype(dt), "indices": ids}
        return {"permuted_output_grad": rng.standard_normal((self.tokens * self.topk, self.hidden),
                                                            np.float32).astype(dt),
                "sorted_indices": sorted_indices_from_expert_ids(ids)}

    def attributes(self) -> dict[str, Any]:
        return {} if self.op == FORWARD.op_type else {"num_topk": self.topk}


BENCH = {"bench": tuple(PermuteCase(op, 8192, 8, 1024, dt) for op in (FORWARD.op_type, GRAD.op_type)
                        for dt in ("float32", "bfloat16")),
         "quick": tuple(PermuteCase(op, 512, 8, 256, dt) for op in (FORWARD.op_type, GRAD.op_type)
                        for dt in ("float32", "bfloat16"))}
"""Benchmark shapes of ``geir bench moe_permute`` (full and ``--quick``)."""
