"""The module path of each node of an ONNX file, as PyTorch's dynamo exporter records it: what ``geir show``
clusters the picture by where node names carry no ``/model/layers.0/...`` prefix (TorchScript's exporter writes
that prefix into the names, and ``ir._dot`` reads it there).

``torch.onnx.export(..., dynamo=True)`` (torch 2.13) names nodes ``node_MatMul_12`` and writes the module stack
into each node's ``metadata_props['pkg.torch.onnx.name_scopes']`` as a Python list literal:
``['', 'model', 'model.layers.0', 'model.layers.0.self_attn', 'view_2']``: the root module (''), each enclosing
module by its full dotted path (older torch wrote the attribute names alone), then the FX node. A node made outside
any module is ``['_empty_nn_module_stack_from_metadata_hook', 'sym_size_int_13']``.
"""

from __future__ import annotations

import ast

from onnx import ModelProto

__all__ = ["SCOPES_KEY", "common_scope", "node_scopes", "scope_of"]

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
MAX_SCOPE_TEXT = 4096
"""A longer entry is ignored rather than parsed (a file is untrusted input)."""
_NO_MODULE = "_empty_nn_module_stack"


def scope_of(text: str) -> tuple[str, ...] | None:
    """``('model', 'layers.0', 'self_attn')`` from one ``name_scopes`` entry; None when it is no list of strings."""
    if len(text) > MAX_SCOPE_TEXT:
        return None
    try:
        entry = ast.literal_eval(text)
    except Exception:        # untrusted text: ValueError, SyntaxError, TypeError ('{[]: 1}'), Memory/RecursionError
        return None
    if not isinstance(entry, list) or not all(isinstance(e, str) for e in entry):
        return None
    parts: list[str] = []
    parent = ""
    for module in entry[:-1]:                         # the last is the FX node, not a module
        if not module or module.startswith(_NO_MODULE):
            continue
        parts.append(module[len(parent) + 1:] if parent and module.startswith(parent + ".") else module)
        parent = module
    return tuple(parts)


def node_scopes(model: ModelProto) -> dict[str, tuple[str, ...]]:
    """Module path by node name, for the main graph's named nodes that record one. A node the exporter's own
    rewriter made (no record) joins the scope its consumers share, so it is drawn beside them."""
    scopes: dict[str, tuple[str, ...]] = {}
    for node in model.graph.node:
        for prop in node.metadata_props:
            if prop.key == SCOPES_KEY and node.name:
                scope = scope_of(prop.value)
                if scope is not None:
                    scopes[node.name] = scope
    if not scopes:
        return scopes
    readers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    for node in reversed(model.graph.node):
        if node.name and node.name not in scopes:
            found = [scopes[r] for out in node.output for r in readers.get(out, ()) if r in scopes]
            if found:
                scopes[node.name] = common_scope(found)
    return scopes


def common_scope(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The longest module path every one of ``paths`` starts with (where a node made for several belongs)."""
    common: tuple[str, ...] = ()
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common += (parts[0],)
    return common
