"""The generated type stubs are current and say what runs: the GraphEditor stub (the op methods of GraphBuilder and
``op()`` typed by op name) and the ``ge.op`` stub (a class per op with its accessors)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import geir
from geir import ge
from geir.schemas import all_schemas
from geir.tools.ge._operator import attribute_names
from geir.tools.stubs import GE_OP_STUB_PATH, STUB_PATH, op_results, standard_op_types, stubs


def test_the_checked_in_stubs_are_what_the_schemas_generate():
    for path, text in stubs().items():
        assert path.read_text() == text, f"{path} is stale: run python -m geir.tools.stubs"


def test_the_stub_declares_every_op_and_parses():
    tree = ast.parse(STUB_PATH.read_text())
    builder = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GraphEditor")
    methods = {n.name: n for n in builder.body if isinstance(n, ast.FunctionDef)}
    for schema in all_schemas():
        method = methods[schema.op_type]
        keywords = [a.arg for a in method.args.kwonlyargs]
        assert keywords == [a.name for a in schema.attributes] + ["name"], schema.op_type
        assert [a.arg for a in method.args.args[1:]] == [s.name for s in schema.inputs], schema.op_type
    assert {"extend", "copy", "copy_from", "add_node", "input", "output", "constant", "op"} <= set(methods)
    assert (Path(STUB_PATH).parents[1] / "py.typed").exists()


def test_the_ge_stub_declares_every_class_and_accessor_that_ge_op_makes():
    tree = ast.parse(GE_OP_STUB_PATH.read_text())
    classes = {n.name: {m.name for m in n.body if isinstance(m, ast.FunctionDef)}
               for n in tree.body if isinstance(n, ast.ClassDef)}
    names = [s.op_type for s in all_schemas()] + standard_op_types()
    assert set(classes) == set(names)
    for name in names:
        made = getattr(ge.op, name)
        generated = {m for m in vars(made) if m.split("_")[0] in ("set", "get", "update")}
        assert classes[name] == {m for m in generated if m.isidentifier()}, name
        assert {f"set_attr_{a}" for a in attribute_names(made.schema)} <= generated, name


def _results(b: geir.GraphBuilder, x: geir.Value, name: str, *extra: geir.Value | None, **attributes):
    made = b.op(name, x, *extra, **attributes)
    return "Value" if isinstance(made, geir.Value) else (len(made), all(isinstance(v, geir.Value) for v in made))


def test_op_returns_what_its_overload_says():
    """op()'s stub types by op name: one output a Value, a fixed count a tuple of that length, a count per node
    (Split) a tuple even of one. The runtime agrees, for each kind of result."""
    results = op_results()
    assert results["Add"] == results["InplacePartialRotaryMul"] == "Value"
    assert results["Split"] == "tuple[Value, ...]"
    assert results["TopK"] == results["Dropout"] == results["MoeTokenUnpermuteGrad"] == "tuple[Value, Value]"
    assert results["SparseFlashAttentionGrad"].startswith("tuple[Value, Value, Value | None")
    b = geir.GraphBuilder("results")
    x = b.input("x", "float32", (2, 1, 1, 4))
    k = b.constant("k", np.array([1], np.int64))
    assert _results(b, x, "Add", x) == "Value"
    assert _results(b, x, "InplacePartialRotaryMul", x, x, partial_slice=[0, 4]) == "Value"
    assert _results(b, x, "Split", axis=3, num_outputs=2) == (2, True)
    assert _results(b, x, "Split", axis=3, num_outputs=1) == (1, True)   # a tuple, as the overload says
    assert _results(b, x, "Split", axis=3, outputs=1) == (1, True)
    assert _results(b, x, "TopK", k, axis=3) == (2, True)
    assert _results(b, x, "Dropout") == (2, True)
    assert _results(b, x, "LayerNormalization", b.constant("s", np.ones(4, np.float32))) == (3, True)


def test_op_with_a_fixed_count_refuses_outputs():
    b = geir.GraphBuilder("fixed")
    x = b.input("x", "float32", (2,))
    with pytest.raises(geir.GraphError, match=r"outputs=: the op has a fixed number of outputs \(1\)"):
        b.op("Neg", x, outputs=1)
