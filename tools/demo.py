"""``geir demo``: build the spec's graph-mode examples, run them, compare with the expected values.

Expected values are the spec's worked examples (exact decimals). Cases in float16/bfloat16
feed the same decimals rounded to that dtype, so their tolerance is the input rounding's
effect: a few units of the dtype's precision times the size of the terms.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import geir

from ..runtimes import runtime_names
from ._table import format_table

ROPE, ROPE_GRAD = "InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
"""Max abs error allowed for results of magnitude <= 16 computed from rounded inputs."""


Builder = Callable[[], tuple[geir.Graph, dict[str, np.ndarray]]]


@dataclass
class DemoCase:
    """One graph, its feeds, and the expected value of each graph output (one array: output 'y')."""

    name: str
    op: str
    dtype: str
    build: Builder
    expected: np.ndarray | dict[str, np.ndarray]
    round_trip: str = "not run"
    expected_warning: str | None = None
    """The rule id of a contract warning the case triggers on purpose (not shown in the demo)."""

    def run(self, runtime: str = "numpy") -> tuple[float, bool]:
        with warnings.catch_warnings():
            if self.expected_warning:
                warnings.filterwarnings("ignore", message=rf"\[{self.expected_warning}\]", category=geir.GeirWarning)
            return self._run(runtime)

    def _run(self, runtime: str) -> tuple[float, bool]:
        graph, feeds = self.build()
        snapshot = {k: v.copy() for k, v in feeds.items()}
        results = geir.run(graph, feeds, runtime=runtime)
        if self.round_trip == "not run":
            self.round_trip = _onnx_round_trip(graph, feeds, results)
        unchanged = all(np.array_equal(snapshot[k], feeds[k]) for k in feeds)
        expected = self.expected if isinstance(self.expected, dict) else {"y": self.expected}
        error, shapes_ok = 0.0, set(results) == set(expected)
        for name, want in expected.items():
            got = results.get(name)
            if got is None or got.shape != np.shape(want):
                shapes_ok = False
                continue
            if got.size:
                error = max(error, float(np.max(np.abs(got.astype(np.float64) - want))))
        return error, unchanged and shapes_ok and error <= TOLERANCE[self.dtype] and self.round_trip == "same"


def _onnx_round_trip(graph: geir.Graph, feeds: dict[str, np.ndarray], results: dict[str, np.ndarray]) -> str:
    """Export (checked with full_check), re-import, run again: 'same' when every output is identical."""
    try:
        again = geir.run(geir.from_onnx(geir.to_onnx(graph)), feeds)
    except Exception as exc:  # reported in the table, and fails the case
        return f"error: {type(exc).__name__}"
    same = set(again) == set(results) and all(np.array_equal(again[k].view(np.uint8), results[k].view(np.uint8))
                                             for k in results)
    return "same" if same else "DIFFERENT"


def _rotary_graph(op: str, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dtype: str, cos_dtype: str,
                  **attrs: object) -> Callable[[], tuple[geir.Graph, dict[str, np.ndarray]]]:
    def build() -> tuple[geir.Graph, dict[str, np.ndarray]]:
        b = geir.GraphBuilder(op.lower())
        feeds = {"x": x.astype(geir.as_dtype(dtype).numpy), "cos": cos.astype(geir.as_dtype(cos_dtype).numpy),
                 "sin": sin.astype(geir.as_dtype(cos_dtype).numpy)}
        values = [b.input(name, arr.dtype, arr.shape) for name, arr in feeds.items()]
        b.output(getattr(b, op)(*values, **attrs), "y")
        return b.build(), feeds
    return build


def _roundtrip_graph(dtype: str) -> Callable[[], tuple[geir.Graph, dict[str, np.ndarray]]]:
    """Forward then grad in one graph: with pair-duplicated tables on the unit circle, grad(fwd(x)) == x."""
    def build() -> tuple[geir.Graph, dict[str, np.ndarray]]:
        angle = np.linspace(0.1, 1.4, 32)
        theta = np.concatenate([angle, angle]).reshape(1, 1, 1, 64)
        np_dt = geir.as_dtype(dtype).numpy
        feeds = {"x": np.tile(np.linspace(-4, 4, 64), (2, 3, 4, 1)).astype(np_dt),
                 "cos": np.cos(theta).astype(np.float32), "sin": np.sin(theta).astype(np.float32)}
        b = geir.GraphBuilder("rope_roundtrip")
        x, cos, sin = (b.input(k, v.dtype, v.shape) for k, v in feeds.items())
        y = b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=0, partial_slice=[0, 64])
        cos_g = b.input("cos_g", np_dt, (1, 1, 1, 64))
        sin_g = b.input("sin_g", np_dt, (1, 1, 1, 64))
        feeds["cos_g"], feeds["sin_g"] = feeds["cos"].astype(np_dt), feeds["sin"].astype(np_dt)
        b.output(b.InplacePartialRotaryMulGrad(y, cos_g, sin_g, rotary_mode=0, partial_slice=[0, 64]), "x_back")
        return b.build(), feeds
    return build


def rotary_cases() -> list[DemoCase]:
    cases: list[DemoCase] = []
    ones = np.ones((1, 1, 1, 128))
    cases.append(DemoCase("GE IR example (E3)", ROPE_GRAD, "float32",
                          _rotary_graph(ROPE_GRAD, 2 * ones, ones, 0 * ones, "float32", "float32",
                                        rotary_mode=1, partial_slice=[0, 128]), 2 * ones))
    dy = np.tile(np.arange(1.0, 9.0), (2, 2, 2, 1))
    cos = np.tile([0.5, 0.6, 0.7, 0.8], (1, 2, 1, 1))
    sin = np.tile([0.1, 0.2, 0.3, 0.4], (1, 2, 1, 1))
    e1 = {  # spec 2.5 E1: mode -> (grad row, forward row)
        0: ([1, 2, 3, 4.8, 3.2, 4, 7, 8], [1, 2, 1, 1.2, 4.4, 6.4, 7, 8]),
        1: ([1, 2, 2.3, 2.1, 5.9, 3.3, 7, 8], [1, 2, 1.1, 3, 1.7, 6.8, 7, 8]),
        2: ([1, 2, 2.3, 2.1, 5.9, 3.3, 7, 8], [1, 2, 1.1, 3, 1.7, 6.8, 7, 8]),
        3: ([1, 2, 3, 3.2, 4.8, 4, 7, 8], [1, 2, 1.1, 1.8, 3.7, 6.8, 7, 8]),
    }
    for mode, (grad_row, fwd_row) in e1.items():
        for op, row in ((ROPE_GRAD, grad_row), (ROPE, fwd_row)):
            label = "CANN example (2,2,2,8)" if mode == 1 and op == ROPE_GRAD else "E1 (2,2,2,8)"
            cases.append(DemoCase(f"{label} mode {mode}", op, "float32",
                                  _rotary_graph(op, dy, cos, sin, "float32", "float32", rotary_mode=mode,
                                                partial_slice=[2, 6]), np.tile(row, (2, 2, 2, 1))))
    x = np.arange(1.0, 9.0).reshape(1, 1, 1, 8)
    c = np.arange(1, 9).reshape(1, 1, 1, 8) / 10
    s = c[..., ::-1].copy()
    e2 = {  # spec 2.5 E2
        0: ([2.1, 2.2, 2.3, 2.4, 1.7, 2.2, 3.1, 4.4], [-3.9, -3.8, -3.3, -2.4, 2.9, 4.2, 5.5, 6.8]),
        1: ([1.5, -0.4, 2.9, -0.2, 4.3, 1.6, 5.7, 5.0], [-1.5, 1.1, -1.5, 3.1, 0.1, 5.1, 3.3, 7.1]),
        2: ([1.9, 2.4, 0.1, 0.2, 3.9, 4.4, 2.9, 4.6], [-2.3, -2.4, 1.5, 2.6, -0.3, 1.2, 5.9, 7.0]),
        3: ([2.1, 1.7, 2.2, 2.2, 2.3, 3.1, 2.4, 4.4], [-1.5, -2.2, -2.1, -1.2, 1.4, 3.3, 5.2, 7.1]),
    }
    for mode, (grad_row, fwd_row) in e2.items():
        for dtype in ("float32", "float16", "bfloat16"):
            for op, row in ((ROPE_GRAD, grad_row), (ROPE, fwd_row)):
                cases.append(DemoCase(f"E2 mode {mode}", op, dtype,
                                      _rotary_graph(op, x, c, s, dtype, dtype, rotary_mode=mode,
                                                    partial_slice=[0, 8]), np.reshape(row, (1, 1, 1, 8))))
    cases.append(DemoCase("E4 default attributes (identity)", ROPE_GRAD, "float16",
                          _rotary_graph(ROPE_GRAD, dy, cos, sin, "float16", "float16"), dy,
                          expected_warning="RP-W1"))
    for dtype in ("float32", "bfloat16"):
        build = _roundtrip_graph(dtype)
        cases.append(DemoCase("forward -> grad in one graph", f"{ROPE} + Grad", dtype, build,
                              {"x_back": build()[1]["x"].astype(np.float64)}))
    return cases


def _moe_graph(with_probs: bool, dtype: str, probs_dtype: str, tokens: np.ndarray, indices: list[int],
               probs: np.ndarray | None) -> Builder:
    def build() -> tuple[geir.Graph, dict[str, np.ndarray]]:
        b = geir.GraphBuilder("moe_unpermute")
        feeds = {"tokens": tokens.astype(geir.as_dtype(dtype).numpy), "indices": np.array(indices, np.int32)}
        if with_probs:
            feeds["probs"] = probs.astype(geir.as_dtype(probs_dtype).numpy)
        values = [b.input(k, v.dtype, v.shape) for k, v in feeds.items()]
        b.output(b.MoeTokenUnpermute(*values), "y")
        return b.build(), feeds
    return build


def _moe_grad_graph(dtype: str, probs_dtype: str, tokens: np.ndarray | None, grad: np.ndarray, indices: list[int],
                    probs: np.ndarray | None) -> Builder:
    def build() -> tuple[geir.Graph, dict[str, np.ndarray]]:
        b = geir.GraphBuilder("moe_unpermute_grad")
        np_dt = geir.as_dtype(dtype).numpy
        feeds = {"grad": grad.astype(np_dt), "indices": np.array(indices, np.int32)}
        t = b.input("tokens", np_dt, tokens.shape) if tokens is not None else None
        g = b.input("grad", np_dt, grad.shape)
        s = b.input("indices", "int32", (len(indices),))
        p = b.input("probs", probs_dtype, probs.shape) if probs is not None else None
        if tokens is not None:
            feeds["tokens"] = tokens.astype(np_dt)
        if probs is not None:
            feeds["probs"] = probs.astype(geir.as_dtype(probs_dtype).numpy)
        ptg, pg = b.MoeTokenUnpermuteGrad(t, g, s, p)
        b.output(ptg, "permuted_tokens_grad")
        b.output(pg, "probs_grad")
        return b.build(), feeds
    return build


def moe_cases() -> list[DemoCase]:
    grad_op, fwd_op = "MoeTokenUnpermuteGrad", "MoeTokenUnpermute"
    ones = np.ones
    cases = [DemoCase("CANN doc example (E1)", grad_op, "float32",
                      _moe_grad_graph("float32", "float32", ones((3, 2)), ones((1, 2)), [0, 1, 2], ones((1, 3))),
                      {"permuted_tokens_grad": ones((3, 2)), "probs_grad": np.array([[2.0, 2.0, 2.0]])})]
    rows = np.arange(1.0, 13.0).reshape(4, 3)
    probs = np.array([[0.5, 0.25], [1.0, 2.0]])
    grad = np.array([[1.0, 0.0, -1.0], [2.0, 1.0, 0.0]])
    for dtype in ("float32", "float16", "bfloat16"):
        probs_dtype = "float32" if dtype == "bfloat16" else dtype
        cases.append(DemoCase("E2 with probs", fwd_op, dtype, _moe_graph(True, dtype, probs_dtype, rows, [2, 0, 3, 1], probs),
                              np.array([[3.75, 4.5, 5.25], [18.0, 21.0, 24.0]])))
        cases.append(DemoCase("E2 with probs", grad_op, dtype,
                              _moe_grad_graph(dtype, probs_dtype, rows, grad, [2, 0, 3, 1], probs),
                              {"permuted_tokens_grad": np.array([[0.25, 0, -0.25], [4, 2, 0], [0.5, 0, -0.5], [2, 1, 0]]),
                               "probs_grad": np.array([[-2.0, -2.0], [31.0, 13.0]])}))
        constant = np.repeat(np.array([1.0, 0, 0, 3, 2, 1, 2, 3])[:, None], 3, axis=1)
        cases.append(DemoCase("MindSpore example, no probs (E3)", fwd_op, dtype,
                              _moe_graph(False, dtype, dtype, constant, [0, 6, 7, 5, 3, 1, 2, 4], None),
                              np.repeat(np.array([1.0, 2, 3, 1, 3, 0, 0, 2])[:, None], 3, axis=1)))
        cases.append(DemoCase("no probs: ptg[s] = dY", grad_op, dtype,
                              _moe_grad_graph(dtype, dtype, None, grad, [1, 0], None),
                              {"permuted_tokens_grad": grad[::-1], "probs_grad": np.zeros((2, 1))}))
    cases.append(DemoCase("dropped slot (E5)", fwd_op, "float32",
                          _moe_graph(True, "float32", "float32", rows[:3], [3, 0, 1, 2], ones((2, 2))),
                          np.array([rows[0], rows[1] + rows[2]])))
    return cases


def _sfa_train_graph(layout: str, dtype: str) -> Builder:
    """Forward and grad in one graph (the forward's out and stats feed the grad) on spec 4.9 E1 data.

    TND runs two batches that each hold E1's data, so both must give E1's numbers.
    """
    def build() -> tuple[geir.Graph, dict[str, np.ndarray]]:
        np_dt = geir.as_dtype(dtype).numpy
        keys = np.array([[1.0] * 4, [2.0] * 4, [2.0, 0, 1, 1], [4.0] * 4])
        values = np.repeat(np.arange(1.0, 5.0), 4).reshape(4, 4)
        batches = 1 if layout == "BSND" else 2
        if layout == "BSND":
            shape_q, shape_kv, shape_i = (1, 1, 2, 4), (1, 4, 1, 4), (1, 1, 1, 4)
        else:
            shape_q, shape_kv, shape_i = (2, 2, 4), (8, 1, 4), (2, 1, 4)
        feeds = {"query": np.ones(shape_q, np_dt),
                 "key": np.tile(keys, (batches, 1)).reshape(shape_kv).astype(np_dt),
                 "value": np.tile(values, (batches, 1)).reshape(shape_kv).astype(np_dt),
                 "sparse_indices": np.tile([0, 2, -1, -1], batches).reshape(shape_i).astype(np.int32)}
        lengths = {}
        if layout == "TND":
            feeds["actual_seq_lengths_query"] = np.array([1, 2], np.int32)
            feeds["actual_seq_lengths_kv"] = np.array([4, 8], np.int32)
        b = geir.GraphBuilder(f"sfa_train_{layout.lower()}")
        inputs = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items()}
        if layout == "TND":
            lengths = {k: inputs[k] for k in ("actual_seq_lengths_query", "actual_seq_lengths_kv")}
        feeds["d_out"] = np.ones(shape_q, np_dt)
        d_out = b.input("d_out", np_dt, shape_q)
        common = dict(scale_value=0.5, sparse_mode=0)
        out, mx, sm = b.SparseFlashAttention(**inputs, layout_query=layout, layout_kv=layout, return_softmax_lse=True,
                                             **common)
        d_q, d_k, d_v, _, _ = b.SparseFlashAttentionGrad(inputs["query"], inputs["key"], inputs["sparse_indices"], d_out,
                                                         out, mx, sm, inputs["value"], layout=layout, **lengths, **common)
        for name, value in (("attention_out", out), ("softmax_max", mx), ("softmax_sum", sm), ("d_query", d_q),
                            ("d_key", d_k), ("d_value", d_v)):
            b.output(value, name)
        return b.build(), feeds
    return build


def sfa_cases() -> list[DemoCase]:
    cases = []
    for layout in ("BSND", "TND"):
        batches = 1 if layout == "BSND" else 2
        stats = (1, 1, 1, 2) if layout == "BSND" else (1, 2, 2)
        q_shape = (1, 1, 2, 4) if layout == "BSND" else (2, 2, 4)
        kv_shape = (1, 4, 1, 4) if layout == "BSND" else (8, 1, 4)
        expected = {"attention_out": np.full(q_shape, 2.0), "softmax_max": np.full(stats, 2.0),
                    "softmax_sum": np.full(stats, 2.0), "d_query": np.broadcast_to([1.0, -1, 0, 0], q_shape),
                    "d_key": np.tile(np.repeat([[-2.0], [0], [2], [0]], 4, axis=1), (batches, 1)).reshape(kv_shape),
                    "d_value": np.tile(np.repeat([[1.0], [0], [1], [0]], 4, axis=1), (batches, 1)).reshape(kv_shape)}
        for dtype in ("float16", "bfloat16"):
            cases.append(DemoCase(f"E1 forward -> grad, {layout}", "SparseFlashAttention + Grad", dtype,
                                  _sfa_train_graph(layout, dtype), expected))
    return cases


def all_cases() -> list[DemoCase]:
    return rotary_cases() + moe_cases() + sfa_cases()




def run_demo(runtime: str | None = None) -> int:
    """Print the demo table (one error column per runtime); return the number of failed cases."""
    runtimes = tuple(runtime_names()) if runtime is None else (runtime,)
    rows, failed = [], 0
    for case in all_cases():
        errors, ok = [], True
        for name in runtimes:
            error, passed = case.run(name)
            errors.append(f"{error:.3g}")
            ok &= passed
        failed += not ok
        rows.append((case.name, case.op, case.dtype, *errors, f"{TOLERANCE[case.dtype]:g}", case.round_trip,
                     "pass" if ok else "FAIL"))
    print("geir demo: the operator contract's graph-mode examples, on " + " and ".join(runtimes) + "; each graph "
          "is also\nexported to ONNX (checker full_check), imported back and run again")
    if "onnxruntime" in runtimes:
        from ..runtimes.onnxruntime import native_status

        print(f"onnxruntime: {native_status()}")
    print()
    headers = ("case", "op", "dtype", *(f"max error ({name})" for name in runtimes), "tolerance", "ONNX round trip",
               "result")
    print(format_table(headers, rows))
    print(f"\n{len(rows) - failed}/{len(rows)} cases passed")
    return failed
