"""Fuzz: mutate valid exported models (their bytes and their protobuf fields) and import them; each must
give a Graph or a GraphError, nothing else. Runs in a child interpreter, so a crash in onnx's C++ code
fails the test instead of killing the suite; bounded in count and time."""

from __future__ import annotations

from native_helpers import run_isolated

FUZZ = r"""
import random, sys, time, traceback, warnings
import numpy as np
import onnx
import geir
from geir import GraphError
sys.path.insert(0, "tests")
from moe.helpers import moe_grad_graph
from rotary.helpers import rotary_graph
from sparse_attention.helpers import SFA, AttentionCase, sfa_graph

warnings.simplefilter("ignore")
seeds = []
seeds.append(geir.to_onnx(rotary_graph("InplacePartialRotaryMulGrad", ("B", 2, 2, 8), (1, 2, 1, 4), "float16",
                                       rotary_mode=1, partial_slice=[2, 6])))
seeds.append(geir.to_onnx(moe_grad_graph((6, 4), (3, 4), 6, (3, 2), "bfloat16", "float32")))
case = AttentionCase(layout="TND", Dr=4)
seeds.append(geir.to_onnx(sfa_graph(case.arrays(), SFA, **case.forward_attrs())[0]))
b = geir.GraphBuilder("mixed")
x = b.input("x", "float32", (2, 6))
left, right = b.op("Split", x, axis=1, num_outputs=2)
b.output(b.op("Softmax", b.op("Add", left, right), axis=-1), "y")
seeds.append(geir.to_onnx(b.build()))

def mutate_bytes(data, rng):
    data = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        if kind < 0.5 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind < 0.7:
            data = data[: rng.randrange(len(data) + 1)]
        elif kind < 0.85:
            at = rng.randrange(len(data) + 1)
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif data:
            start = rng.randrange(len(data))
            del data[start:start + rng.randint(1, 32)]
    return bytes(data)

def mutate_fields(model, rng):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    choices = []
    if g.node:
        choices += ["op", "domain", "drop_input", "rename_input", "attr", "dup_node", "drop_node", "extra_output"]
    if g.input:
        choices += ["dim", "dtype", "dup_input", "drop_graph_input"]
    choices += ["opset", "ir", "function_body", "value_info", "initializer"]
    for _ in range(rng.randint(1, 3)):
        what = rng.choice(choices)
        node = g.node[rng.randrange(len(g.node))] if g.node else None
        if what == "op":
            node.op_type = rng.choice(["Relu", "Split", "Softmax", "MoeTokenUnpermute", "SparseFlashAttentionGrad",
                                       "Nope", "Loop", "Constant"])
        elif what == "domain":
            node.domain = rng.choice(["", "ai.cann", "com.x", "ai.onnx"])
        elif what == "drop_input" and node.input:
            del node.input[rng.randrange(len(node.input))]
        elif what == "rename_input" and node.input:
            node.input[rng.randrange(len(node.input))] = rng.choice(["", "ghost", g.input[0].name if g.input else ""])
        elif what == "attr":
            if node.attribute and rng.random() < 0.5:
                a = node.attribute[rng.randrange(len(node.attribute))]
                a.type = rng.randrange(0, 15)
                a.i = rng.choice([-1, 0, 2**62, -(2**63)])
                a.ints[:] = [rng.randint(-5, 5) for _ in range(rng.randint(0, 4))]
                a.f = rng.choice([float("nan"), float("inf"), -1.0])
            else:
                node.attribute.append(onnx.helper.make_attribute(rng.choice(["axis", "rotary_mode", "zzz"]),
                                                                 rng.randint(-3, 3)))
        elif what == "dup_node":
            g.node.append(onnx.NodeProto.FromString(node.SerializeToString()))
        elif what == "drop_node":
            g.node.remove(node)
        elif what == "extra_output":
            node.output.append(f"extra{rng.randrange(9)}")
        elif what == "dim":
            vi = g.input[rng.randrange(len(g.input))]
            dims = vi.type.tensor_type.shape.dim
            if dims:
                d = dims[rng.randrange(len(dims))]
                if rng.random() < 0.5:
                    d.dim_value = rng.choice([0, 1, 3, 2**40, 2**62])
                else:
                    d.dim_param = rng.choice(["B", "", "1x", "T"])
        elif what == "dtype":
            g.input[rng.randrange(len(g.input))].type.tensor_type.elem_type = rng.randrange(0, 25)
        elif what == "dup_input":
            g.input.append(g.input[rng.randrange(len(g.input))])
        elif what == "drop_graph_input":
            del g.input[rng.randrange(len(g.input))]
        elif what == "opset":
            model.opset_import[rng.randrange(len(model.opset_import))].version = rng.choice([0, 1, 7, 11, 13, 21, 999])
        elif what == "ir":
            model.ir_version = rng.choice([0, 1, 3, 7, 11, 99])
        elif what == "function_body" and model.functions:
            f = model.functions[rng.randrange(len(model.functions))]
            if f.node:
                victim = f.node[rng.randrange(len(f.node))]
                victim.op_type = rng.choice(["Relu", "Nope", f.name])
                victim.domain = rng.choice(["", f.domain])
        elif what == "value_info" and g.value_info:
            g.value_info[rng.randrange(len(g.value_info))].type.tensor_type.elem_type = rng.randrange(0, 25)
        elif what == "initializer":
            t = g.initializer.add()
            t.name = rng.choice(["w", g.input[0].name if g.input else "w"])
            t.data_type = rng.randrange(0, 20)
            t.dims.extend([rng.choice([-1, 0, 2, 2**40])])
    return model

rng = random.Random(int(sys.argv[1]))
deadline = time.monotonic() + float(sys.argv[3])
count = ok = refused = 0
while count < int(sys.argv[2]) and time.monotonic() < deadline:
    seed = rng.choice(seeds)
    try:
        if rng.random() < 0.5:
            data = mutate_bytes(seed.SerializeToString(), rng)
        else:
            data = mutate_fields(seed, rng).SerializeToString()
    except Exception:      # a mutation protobuf itself refuses to serialise: not an input
        continue
    count += 1
    try:
        result = geir.from_onnx(data)
        assert isinstance(result, geir.Graph)
        ok += 1
    except GraphError:
        refused += 1
    except Exception:
        print("ESCAPED", type(sys.exc_info()[1]).__name__, data.hex()[:400])
        traceback.print_exc()
        sys.exit(1)
print("done", count, ok, refused)
"""


def test_mutated_models_import_or_raise_graph_error():
    result = run_isolated("import sys; sys.argv = ['fuzz', '20261201', '600', '60']\n" + FUZZ, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1].split()
    assert summary[0] == "done" and int(summary[1]) >= 100, result.stdout[-500:]
    assert int(summary[3]) > 0        # the mutations do reach the refusals
