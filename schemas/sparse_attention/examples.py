"""The sparse attention ops' worked example (spec 4.9 E1), exact in float16 and bfloat16."""

from __future__ import annotations

import numpy as np

from .._examples import Example, register_examples
from .schema import FORWARD, GRAD

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
