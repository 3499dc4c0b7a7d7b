"""geir.ir: the ground floor. The core (dtypes, tensor types with symbolic dims, values, nodes, graphs, errors,
files) and the machinery every layer above needs: the schema protocol and ``OpSchema``, the one registry keyed
(domain, op type), the standard-op adapter, ``GraphEditor`` (adds checked nodes to a graph) and the ONNX export
with its body and lowering machinery. It imports nothing from schemas, passes, runtimes or tools
(tests/test_layering.py holds it to that)."""

from __future__ import annotations
