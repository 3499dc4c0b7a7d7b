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

from ..ir._core import Graph
from ..ir._dtypes import as_dtype
from ..ir._errors import GeirWarning
from ..ir._onnx_export import to_onnx
from .builder import GraphBuilder
from .facade import run
from .onnx_import import from_onnx
from ..runtimes import runtime_names
from ..schemas import Example, all_examples
from ..schemas.sparse_attention.examples import E1_KEY, E1_VALUE
from ._table import format_table

ROPE, ROPE_GRAD = "InplacePartialRotaryMul", "InplacePartialRotaryMulGrad"
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2, "int8": 0.0}
"""Max abs error allowed for results of magnitude <= 16 computed from rounded inputs."""


Builder = Callable[[], tuple[Graph, dict[str, np.ndarray]]]


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
                warnings.filterwarnings("ignore", message=rf"\[{self.expected_warning}\]", category=GeirWarning)
            return self._run(runtime)

    def _run(self, runtime: str) -> tuple[float, bool]:
        graph, feeds = self.build()
        snapshot = {k: v.copy() for k, v in feeds.items()}
        results = run(graph, feeds, runtime=runtime)
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


def _onnx_round_trip(graph: Graph, feeds: dict[str, np.ndarray], results: dict[str, np.ndarray]) -> str:
    """Export (checked with full_check), re-import, run again: 'same' when every output is identical."""
    try:
        again = run(from_onnx(to_onnx(graph)), feeds)
    except Exception as exc:  # reported in the table, and fails the case
        return f"error: {type(exc).__name__}"
    same = set(again) == set(results) and all(np.array_equal(again[k].view(np.uint8), results[k].view(np.uint8))
                                             for k in results)
    return "same" if same else "DIFFERENT"


def _roundtrip_graph(dtype: str) -> Callable[[], tuple[Graph, dict[str, np.ndarray]]]:
    """Forward then grad in one graph: with pair-duplicated tables on the unit circle, grad(fwd(x)) == x."""
    def build() -> tuple[Graph, dict[str, np.ndarray]]:
        angle = np.linspace(0.1, 1.4, 32)
        theta = np.concatenate([angle, angle]).reshape(1, 1, 1, 64)
        np_dt = as_dtype(dtype).numpy
        feeds = {"x": np.tile(np.linspace(-4, 4, 64), (2, 3, 4, 1)).astype(np_dt),
                 "cos": np.cos(theta).astype(np.float32), "sin": np.sin(theta).astype(np.float32)}
        b = GraphBuilder("rope_roundtrip")
        x, cos, sin = (b.input(k, v.dtype, v.shape) for k, v in feeds.items())
        y = b.InplacePartialRotaryMul(x, cos, sin, rotary_mode=0, partial_slice=[0, 64])
        cos_g = b.input("cos_g", np_dt, (1, 1, 1, 64))
        sin_g = b.input("sin_g", np_dt, (1, 1, 1, 64))
        feeds["cos_g"], feeds["sin_g"] = feeds["cos"].astype(np_dt), feeds["sin"].astype(np_dt)
        b.output(b.InplacePartialRotaryMulGrad(y, cos_g, sin_g, rotary_mode=0, partial_slice=[0, 64]), "x_back")
        return b.build(), feeds
    return build


def _output_name(schema, index: int) -> str:
    """Graph output name of a schema output: its own, unless an input has it (in-place ops)."""
    name = schema.outputs[index].name
    return f"{name}_out" if name in {s.name for s in schema.inputs} else name


def _example_graph(example: Example, dtype: str) -> Builder:
    """One node of the example's op on its inputs, cast as the example says for a run of ``dtype``."""
    def build() -> tuple[Graph, dict[str, np.ndarray]]:
        schema = example.schema
        b = GraphBuilder(schema.op_type.lower())
        feeds = {name: np.asarray(array).astype(as_dtype(example.input_dtype(name, dtype)).numpy)
                 for name, array in example.inputs.items()}
        values = {name: b.input(name, array.dtype, array.shape) for name, array in feeds.items()}
        results = b.add_node(schema, [values.get(s.name) for s in schema.inputs], dict(example.attributes))
        for i, value in enumerate(results if isinstance(results, tuple) else (results,)):
            if value is not None:
                b.output(value, _output_name(schema, i))
        return b.build(), feeds
    return build


def example_cases() -> list[DemoCase]:
    """The worked examples every family declares (``schemas/<family>/examples.py``), once per dtype."""
    cases = []
    for example in all_examples():
        schema = example.schema
        index = {s.name: i for i, s in enumerate(schema.outputs)}
        expected = {_output_name(schema, index[name]): np.asarray(value, np.float64)
                    for name, value in example.expected.items()}
        for dtype in example.dtypes:
            cases.append(DemoCase(example.name, schema.op_type, dtype, _example_graph(example, dtype), expected,
                                  expected_warning=example.warning))
    return cases


def rotary_graph_cases() -> list[DemoCase]:
    """Forward then grad of the rotary ops in one graph."""
    cases = []
    for dtype in ("float32", "bfloat16"):
        build = _roundtrip_graph(dtype)
        cases.append(DemoCase("forward -> grad in one graph", f"{ROPE} + Grad", dtype, build,
                              {"x_back": build()[1]["x"].astype(np.float64)}))
    return cases


def _sfa_train_graph(layout: str, dtype: str) -> Builder:
    """Forward and grad in one graph (the forward's out and stats feed the grad) on spec 4.9 E1 data.

    TND runs two batches that each hold E1's data, so both must give E1's numbers.
    """
    def build() -> tuple[Graph, dict[str, np.ndarray]]:
        np_dt = as_dtype(dtype).numpy
        keys, values = E1_KEY.reshape(4, 4), E1_VALUE.reshape(4, 4)      # spec 4.9 E1, declared by the family
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
        b = GraphBuilder(f"sfa_train_{layout.lower()}")
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


def sfa_graph_cases() -> list[DemoCase]:
    """Forward then grad of sparse attention in one graph, BSND and TND."""
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


def _sfa_paged_graph(layout: str, dtype: str) -> Builder:
    """Spec 4.9 E1 read through a paged KV cache (4.11): E1's four keys live on page 2 of a 3-page cache
    (TND: a second batch's copy on page 0), the other rows noise, the table padded with -1."""
    def build() -> tuple[Graph, dict[str, np.ndarray]]:
        np_dt = as_dtype(dtype).numpy
        rng = np.random.default_rng(0)
        keys, values = E1_KEY.reshape(4, 1, 4), E1_VALUE.reshape(4, 1, 4)
        key_cache = rng.standard_normal((3, 16, 1, 4))
        value_cache = rng.standard_normal((3, 16, 1, 4))
        batches = 1 if layout == "BSND" else 2
        pages = [2] if layout == "BSND" else [2, 0]
        for page in pages:
            key_cache[page, :4], value_cache[page, :4] = keys, values
        feeds = {"query": np.ones((1, 1, 2, 4) if layout == "BSND" else (2, 2, 4), np_dt),
                 "key": key_cache.astype(np_dt), "value": value_cache.astype(np_dt),
                 "sparse_indices": np.tile([0, 2, -1, -1], batches).reshape(
                     (1, 1, 1, 4) if layout == "BSND" else (2, 1, 4)).astype(np.int32),
                 "block_table": np.array([[p, -1] for p in pages], np.int32),
                 "actual_seq_lengths_kv": np.full(batches, 4, np.int32)}
        if layout == "TND":
            feeds["actual_seq_lengths_query"] = np.array([1, 2], np.int32)
        b = GraphBuilder(f"sfa_paged_{layout.lower()}")
        inputs = {k: b.input(k, v.dtype, v.shape) for k, v in feeds.items()}
        out, _, _ = b.SparseFlashAttention(**inputs, scale_value=0.5, sparse_mode=0, layout_query=layout,
                                           layout_kv="PA_BSND")
        b.output(out, "attention_out")
        return b.build(), feeds
    return build


def sfa_paged_cases() -> list[DemoCase]:
    """E1 through a paged KV cache, BSND and TND queries: the same numbers as the dense E1."""
    cases = []
    for layout in ("BSND", "TND"):
        shape = (1, 1, 2, 4) if layout == "BSND" else (2, 2, 4)
        for dtype in ("float16", "bfloat16"):
            cases.append(DemoCase(f"E1 through a paged KV cache, {layout}", "SparseFlashAttention (PA_BSND)", dtype,
                                  _sfa_paged_graph(layout, dtype), {"attention_out": np.full(shape, 2.0)}))
    return cases


def all_cases() -> list[DemoCase]:
    """Every family's worked examples, then the graphs that chain a forward op into its grad."""
    return example_cases() + rotary_graph_cases() + sfa_graph_cases() + sfa_paged_cases()




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
