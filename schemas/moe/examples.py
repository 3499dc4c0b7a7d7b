"""The MoE unpermute ops' example cases: the worked examples (spec 3.5), exact in every dtype, and
``MoeCase``, random routed inputs, whose ``BENCH`` instances ``geir bench`` measures."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ir._dtypes import as_dtype
from .indices import sorted_indices_from_expert_ids
from .._examples import Example, register_examples
from .schema import FORWARD, GRAD

E2_ROWS = np.arange(1.0, 13.0).reshape(4, 3)
E2_INDICES = np.array([2, 0, 3, 1], np.int32)
E2_PROBS = np.array([[0.5, 0.25], [1.0, 2.0]])
E2_DY = np.array([[1.0, 0.0, -1.0], [2.0, 1.0, 0.0]])
E2_FORWARD = np.array([[3.75, 4.5, 5.25], [18.0, 21.0, 24.0]])
E2_PTG = np.array([[0.25, 0, -0.25], [4, 2, 0], [0.5, 0, -0.5], [2, 1, 0]])
E2_PG = np.array([[-2.0, -2.0], [31.0, 13.0]])
ALL = ("float32", "float16", "bfloat16")
BF16_PROBS_F32 = {"bfloat16": {"probs": "float32"}}


def _examples() -> list[Example]:
    ones = np.ones
    constant = np.repeat(np.array([1.0, 0, 0, 3, 2, 1, 2, 3])[:, None], 3, axis=1)
    return [
        Example("CANN doc example (E1)", GRAD, {"permuted_tokens": ones((3, 2)), "unpermuted_tokens_grad": ones((1, 2)),
                                                "sorted_indices": np.array([0, 1, 2], np.int32), "probs": ones((1, 3))},
                {}, {"permuted_tokens_grad": ones((3, 2)), "probs_grad": np.array([[2.0, 2.0, 2.0]])}),
        Example("E2 with probs", FORWARD, {"permuted_tokens": E2_ROWS, "sorted_indices": E2_INDICES, "probs": E2_PROBS},
                {}, {"unpermuted_tokens": E2_FORWARD}, ALL, BF16_PROBS_F32),
        Example("E2 with probs", GRAD, {"permuted_tokens": E2_ROWS, "unpermuted_tokens_grad": E2_DY,
                                        "sorted_indices": E2_INDICES, "probs": E2_PROBS},
                {}, {"permuted_tokens_grad": E2_PTG, "probs_grad": E2_PG}, ALL, BF16_PROBS_F32,
                warning="MG-W2"),   # its bfloat16 run has float32 probs: the pair that is NaN on the device
        Example("MindSpore example, no probs (E3)", FORWARD,
                {"permuted_tokens": constant, "sorted_indices": np.array([0, 6, 7, 5, 3, 1, 2, 4], np.int32)}, {},
                {"unpermuted_tokens": np.repeat(np.array([1.0, 2, 3, 1, 3, 0, 0, 2])[:, None], 3, axis=1)}, ALL),
        Example("no probs: ptg[s] = dY", GRAD, {"unpermuted_tokens_grad": E2_DY,
                                                "sorted_indices": np.array([1, 0], np.int32)},
                {}, {"permuted_tokens_grad": E2_DY[::-1], "probs_grad": np.zeros((2, 1))}, ALL),
        Example("dropped slot (E5)", FORWARD, {"permuted_tokens": E2_ROWS[:3],
                                               "sorted_indices": np.array([3, 0, 1, 2], np.int32), "probs": ones((2, 2))},
                {}, {"unpermuted_tokens": np.array([E2_ROWS[0], E2_ROWS[1] + E2_ROWS[2]])}),
    ]


register_examples(*_examples())


@dataclass(frozen=True)
class MoeCase:
    """``tokens`` tokens each routed to ``topk`` distinct experts of ``experts`` (uniformly), hidden size
    ``hidden``: the grad's inputs (the forward takes permuted_tokens, sorted_indices, probs)."""

    tokens: int
    topk: int
    hidden: int
    dtype: str = "float32"
    experts: int = 64
    seed: int = 0

    def arrays(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        dt = as_dtype(self.dtype).numpy
        choice = np.argsort(rng.random((self.tokens, self.experts)), axis=1)[:, :self.topk]   # realistic routing
        return {"permuted_tokens": rng.standard_normal((self.tokens * self.topk, self.hidden), np.float32).astype(dt),
                "unpermuted_tokens_grad": rng.standard_normal((self.tokens, self.hidden), np.float32).astype(dt),
                "sorted_indices": sorted_indices_from_expert_ids(choice),
                "probs": rng.uniform(0, 1, (self.tokens, self.topk)).astype(dt)}


BENCH = {"bench": tuple(MoeCase(8192, 8, 1024, dt) for dt in ("float32", "bfloat16")),
         "quick": tuple(MoeCase(512, 8, 256, dt) for dt in ("float32", "bfloat16"))}
"""Benchmark shapes of ``geir bench`` (full and ``--quick``)."""
