"""CANN's graph-mode examples, ported step for step to ``geir.ge``, with real (random) data.

``rotary_mul`` and ``rotary_mul_grad`` follow ops-transformer's ``test_geir_inplace_partial_rotary_mul*.cpp``:
GEInitialize with the device options, one Data op per input (index, input and output desc), the op
built by ``set_input_*``/``set_attr_*`` with its descs updated, ``SetInputs/SetOutputs``, a Session
that adds the graph, ``aclgrphDumpGraph``, ``RunGraph``, the error and warning messages, GEFinalize.
CANN has no such example for the MoE and sparse-attention ops; ``moe_token_unpermute_grad`` and
``sparse_flash_attention`` are written the same way. ``geir example NAME`` runs one from the command line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from . import ge
from ..schemas.moe.indices import sorted_indices_from_expert_ids

__all__ = ["EXAMPLES", "ExampleRun"]


@dataclass
class ExampleRun:
    """What an example fed and got back: ``status`` is GE's (``ge.SUCCESS`` or ``ge.FAILED``); ``dump_error`` is
    why ``aclgrphDumpGraph`` failed (the example then stops, as CANN's do on a failed call), None if it did not."""

    name: str
    graph: ge.Graph
    inputs: dict[str, np.ndarray]
    outputs: list[np.ndarray] = field(default_factory=list)
    status: int = ge.FAILED
    messages: list[str] = field(default_factory=list)
    dump_error: str | None = None


def _log(run: ExampleRun, text: str, echo: bool) -> None:
    run.messages.append(text)
    if echo:
        print(f"[XIR]: {text}")


def _data(graph: ge.Graph, name: str, index: int, array: np.ndarray, data_type: int) -> tuple[ge.Operator, ge.Tensor]:
    """One graph input as CANN's examples declare it: a Data op with its index and both descs."""
    desc = ge.TensorDesc(ge.Shape(list(array.shape)), ge.FORMAT_ND, data_type)
    desc.SetPlacement("host")
    data = ge.op.Data(name).set_attr_index(index)
    data.update_input_desc_x(desc)
    data.update_output_desc_y(desc)
    graph.AddOp(data)
    return data, ge.Tensor(desc, array)


def _session_run(run: ExampleRun, tensors: list[ge.Tensor], runtime: str, dump: str | None, echo: bool) -> ExampleRun:
    """The part every example shares: session, AddGraph, dump, RunGraph, messages, GEFinalize."""
    _log(run, f"Start to create ir session (runtime {runtime})", echo)
    session = ge.Session({"geir.runtime": runtime})
    if session.AddGraph(0, run.graph) != ge.SUCCESS:
        _log(run, f"Session add ir compute graph failed: {ge.GEGetErrorMsgV2()}", echo)
        ge.GEFinalize()
        return run
    if dump is not None and ge.aclgrphDumpGraph(run.graph, dump, len(dump)) != ge.SUCCESS:
        run.dump_error = "; ".join(ge.GEGetErrorMsgV2().splitlines())
        _log(run, f"Dump ir compute graph failed: {run.dump_error}", echo)
        ge.GEFinalize()
        return run
    _log(run, "Start to run ir compute graph", echo)
    outputs: list[ge.Tensor] = []
    run.status = session.RunGraph(0, tensors, outputs)
    if run.status != ge.SUCCESS:
        _log(run, f"Run graph failed: {ge.GEGetErrorMsgV2()}", echo)
    else:
        _log(run, "Session run ir compute graph success", echo)
        run.outputs = [t.GetData() for t in outputs]
        for i, tensor in enumerate(outputs):
            dims = tensor.GetTensorDesc().GetShape().GetDims()
            head = ", ".join(f"{v:.4f}" for v in tensor.GetData().astype(np.float64).reshape(-1)[:4])
            _log(run, f"output {i}: shape {dims}, first values [{head}]", echo)
    _log(run, f"Error message: {ge.GEGetErrorMsgV2()}", echo)
    _log(run, f"Warning message: {ge.GEGetWarningMsgV2()}", echo)
    ge.GEFinalize()
    return run


def _initialize(run: ExampleRun, echo: bool) -> bool:
    _log(run, "Start to initialize ge on device 0 using ge global options", echo)
    ok = ge.GEInitialize({"ge.exec.deviceId": "0", "ge.graphRunMode": "1"}) == ge.SUCCESS
    _log(run, "Initialize ge using ge global options " + ("success" if ok else f"failed: {ge.GEGetErrorMsgV2()}"), echo)
    return ok


def _rotary(grad: bool, runtime: str, dump: str | None, echo: bool, seed: int) -> ExampleRun:
    batch, seq, heads, head_dim, start, end, mode = 1, 1, 1, 128, 0, 128, 1     # the constants of CANN's example
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, seq, heads, head_dim)).astype(np.float32)
    angle = rng.uniform(0, np.pi, (batch, seq, heads, end - start))
    arrays = {"dy" if grad else "x": x, "cos": np.cos(angle).astype(np.float32), "sin": np.sin(angle).astype(np.float32)}
    name = "inplace_partial_rotary_mul" + ("_grad" if grad else "")
    run = ExampleRun(name, ge.Graph("tc_ge_irrun_test"), arrays)
    if not _initialize(run, echo):
        return run
    tensors, data = [], []
    for index, (input_name, array) in enumerate(arrays.items()):
        op, tensor = _data(run.graph, input_name, index, array, ge.DT_FLOAT)
        data.append(op)
        tensors.append(tensor)
    cls = ge.op.InplacePartialRotaryMulGrad if grad else ge.op.InplacePartialRotaryMul
    node = cls(f"test_geir_{name}")
    first = "dy" if grad else "x"
    getattr(node, f"set_input_{first}")(data[0]).set_input_cos(data[1]).set_input_sin(data[2])
    getattr(node, f"update_input_desc_{first}")(tensors[0].GetTensorDesc())
    node.update_input_desc_cos(tensors[1].GetTensorDesc()).update_input_desc_sin(tensors[2].GetTensorDesc())
    node.set_attr_rotary_mode(mode).set_attr_partial_slice([start, end])
    getattr(node, f"update_output_desc_{first}")(tensors[0].GetTensorDesc())   # in place: the output is the input
    run.graph.SetInputs(data).SetOutputs([node])
    return _session_run(run, tensors, runtime, dump, echo)


def rotary_mul(runtime: str = "numpy", dump: str | None = None, echo: bool = False, seed: int = 0) -> ExampleRun:
    """CANN's ``test_geir_inplace_partial_rotary_mul.cpp``: mode 1 on a (1, 1, 1, 128) float32 x, slice [0, 128)."""
    return _rotary(False, runtime, dump, echo, seed)


def rotary_mul_grad(runtime: str = "numpy", dump: str | None = None, echo: bool = False, seed: int = 0) -> ExampleRun:
    """CANN's ``test_geir_inplace_partial_rotary_mul_grad.cpp``: the same graph with the gradient op on dy."""
    return _rotary(True, runtime, dump, echo, seed)


def moe_token_unpermute_grad(runtime: str = "numpy", dump: str | None = None, echo: bool = False,
                             seed: int = 0) -> ExampleRun:
    """MoeTokenUnpermuteGrad with probs, bfloat16 tokens and float32 probs: 16 tokens, top-2 of 8 experts, H 256."""
    tokens, topk, hidden, experts = 16, 2, 256, 8
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    choice = np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk]
    arrays = {"permuted_tokens": rng.standard_normal((tokens * topk, hidden)).astype(bf16),
              "unpermuted_tokens_grad": rng.standard_normal((tokens, hidden)).astype(bf16),
              "sorted_indices": sorted_indices_from_expert_ids(choice),
              "probs": rng.uniform(0, 1, (tokens, topk)).astype(np.float32)}
    run = ExampleRun("moe_token_unpermute_grad", ge.Graph("tc_ge_irrun_test"), arrays)
    if not _initialize(run, echo):
        return run
    kinds = {"permuted_tokens": ge.DT_BF16, "unpermuted_tokens_grad": ge.DT_BF16, "sorted_indices": ge.DT_INT32,
             "probs": ge.DT_FLOAT}
    data, tensors = zip(*(_data(run.graph, k, i, a, kinds[k]) for i, (k, a) in enumerate(arrays.items())))
    node = (ge.op.MoeTokenUnpermuteGrad("test_geir_moe_token_unpermute_grad")
            .set_input_permuted_tokens(data[0]).set_input_unpermuted_tokens_grad(data[1])
            .set_input_sorted_indices(data[2]).set_input_probs(data[3]).set_attr_padded_mode(False))
    run.graph.SetInputs(list(data)).SetOutputs([node])
    return _session_run(run, list(tensors), runtime, dump, echo)


def sparse_flash_attention(runtime: str = "numpy", dump: str | None = None, echo: bool = False,
                           seed: int = 0) -> ExampleRun:
    """SparseFlashAttention BSND float16 with rope and softmax statistics: B 1, S1 8, S2 64, N1 4, D 64, Dr 16,
    8 blocks of 4 keys per row, mode 3 (causal over the selected blocks)."""
    from ..schemas.sparse_attention.examples import SfaCase

    case = SfaCase(B=1, S1=8, S2=64, N1=4, D=64, D2=64, Dr=16, K=8, bs=4, mode=3, full=True, seed=seed)
    arrays = {k: v for k, v in case.arrays().items() if v is not None}
    run = ExampleRun("sparse_flash_attention", ge.Graph("tc_ge_irrun_test"), arrays)
    if not _initialize(run, echo):
        return run
    kinds = {np.dtype(np.float16): ge.DT_FLOAT16, np.dtype(np.int32): ge.DT_INT32}
    data, tensors = zip(*(_data(run.graph, k, i, a, kinds[a.dtype]) for i, (k, a) in enumerate(arrays.items())))
    by_name = dict(zip(arrays, data))
    node = ge.op.SparseFlashAttention("test_geir_sparse_flash_attention")
    for input_name, source in by_name.items():
        getattr(node, f"set_input_{input_name}")(source)
    (node.set_attr_scale_value(case.scale).set_attr_sparse_block_size(case.bs).set_attr_layout_query("BSND")
     .set_attr_layout_kv("BSND").set_attr_sparse_mode(case.mode).set_attr_return_softmax_lse(True))
    run.graph.SetInputs(list(data)).SetOutputs([(node, ["attention_out", "softmax_max", "softmax_sum"])])
    return _session_run(run, list(tensors), runtime, dump, echo)


EXAMPLES: dict[str, Callable[..., ExampleRun]] = {
    "inplace_partial_rotary_mul": rotary_mul, "inplace_partial_rotary_mul_grad": rotary_mul_grad,
    "moe_token_unpermute_grad": moe_token_unpermute_grad, "sparse_flash_attention": sparse_flash_attention}
