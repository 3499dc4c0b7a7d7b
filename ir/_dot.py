"""A graph as a picture: Graphviz DOT text, and SVG/PNG through Graphviz's ``dot`` when it is installed.

Inputs are ellipses, constants boxes with a dashed line, nodes boxes naming op type, node name and
attributes; each edge carries the value's name and type, so the picture says what ``str(graph)`` does.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from typing import Any, Protocol

from ._errors import GraphError


class Graph(Protocol):
    """What a picture reads from a ``geir.Graph`` (``_core`` imports this module, so it is not imported here)."""

    name: str
    inputs: Sequence[Any]
    outputs: Sequence[Any]
    constant_values: Sequence[Any]
    nodes: Sequence[Any]

__all__ = ["RENDER_TIMEOUT_S", "graph_to_dot", "render"]

RENDER_TIMEOUT_S = 60
"""Graphviz gets this long to draw a graph."""


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def graph_to_dot(graph: Graph) -> str:
    """The DOT text of ``graph``: one box per node, one ellipse per input and output, typed edges."""
    lines = [f"digraph {_quote(graph.name)} {{", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    source: dict[int, str] = {}
    for i, value in enumerate(graph.inputs):
        source[id(value)] = f"in{i}"
        lines.append(f"  in{i} [shape=ellipse, label={_quote(f'{value.name}: {value.type}')}];")
    for i, value in enumerate(graph.constant_values):
        source[id(value)] = f"const{i}"
        lines.append(f"  const{i} [shape=box, style=dashed, label={_quote(f'{value.name}: {value.type}')}];")
    for i, node in enumerate(graph.nodes):
        attrs = "\n".join(f"{k}={v}" for k, v in node.attributes.items())
        op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        lines.append(f"  n{i} [shape=box, style=rounded, label={_quote(op + chr(10) + repr(node.name) + (chr(10) + attrs if attrs else ''))}];")
        for value in node.outputs:
            if value is not None:
                source[id(value)] = f"n{i}"
    for i, node in enumerate(graph.nodes):
        for value in node.inputs:
            if value is not None:
                lines.append(f"  {source[id(value)]} -> n{i} [label={_quote(f'{value.name}: {value.type}')}];")
    for i, value in enumerate(graph.outputs):
        lines.append(f"  out{i} [shape=ellipse, peripheries=2, label={_quote(value.name)}];")
        lines.append(f"  {source[id(value)]} -> out{i} [label={_quote(str(value.type))}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(graph: Graph, fmt: str) -> bytes:
    """SVG or PNG bytes of ``graph`` drawn by Graphviz; GraphError when ``dot`` is missing or fails."""
    if fmt not in ("svg", "png"):
        raise GraphError(f"render: format: expected svg or png, got {fmt!r}")
    dot = shutil.which("dot")
    if dot is None:
        raise GraphError(f"drawing {fmt.upper()} needs Graphviz's 'dot' on PATH (Debian: apt-get install graphviz); "
                         "the DOT text (format dot) needs nothing")
    try:
        result = subprocess.run([dot, f"-T{fmt}"], input=graph_to_dot(graph).encode(), capture_output=True,
                                timeout=RENDER_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GraphError(f"Graphviz 'dot' failed to draw graph '{graph.name}': {exc}") from None
    if result.returncode != 0 or not result.stdout:
        message = result.stderr.decode(errors="replace").strip().splitlines()[:1] or [f"exit status {result.returncode}"]
        raise GraphError(f"Graphviz 'dot' failed to draw graph '{graph.name}': {message[0]}")
    return result.stdout
