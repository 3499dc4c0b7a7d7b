"""The GraphEditor type stub (the op methods of GraphBuilder) is current: every op method a schema generates is declared, typed."""

from __future__ import annotations

import ast
from pathlib import Path

from geir.schemas import all_schemas
from geir.tools.stubs import STUB_PATH, builder_stub


def test_the_checked_in_stub_is_what_the_schemas_generate():
    assert STUB_PATH.read_text() == builder_stub(), "stale: run python -m geir.tools.stubs"


def test_the_stub_declares_every_op_and_parses():
    tree = ast.parse(STUB_PATH.read_text())
    builder = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GraphEditor")
    methods = {n.name: n for n in builder.body if isinstance(n, ast.FunctionDef)}
    for schema in all_schemas():
        method = methods[schema.op_type]
        keywords = [a.arg for a in method.args.kwonlyargs]
        assert keywords == [a.name for a in schema.attributes] + ["name"], schema.op_type
        assert [a.arg for a in method.args.args[1:]] == [s.name for s in schema.inputs], schema.op_type
    assert (Path(STUB_PATH).parents[1] / "py.typed").exists()
