"""A graph as a picture: Graphviz DOT text, and SVG/PNG through Graphviz's ``dot`` when it is installed.

Drawn the way people read models (Netron is the reference): one box per node, coloured by kind (our ``ai.cann``
ops bold orange); constants and initializers are no boxes of their own but rows of their consumer's label (name,
type, and the values of a handful of numbers); edges carry the type only (``float32[batch,s0,32]``), generated
symbols abbreviated ``s0``, ``s1`` with a legend; nodes are clustered by module, from the ``/model/layers.0/...``
prefix of TorchScript-exported names or the scopes the caller passes (``tools`` reads the dynamo exporter's).
The full node and value names are the SVG's tooltips. Text is O(nodes + edges); ``tests/tools/test_show_picture.py``
holds the rules.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ._dot_text import (LEGEND, OUR_DOMAIN, Symbols, attribute_lines, constant_text, html, node_style, quoted,
                        relative_name, shorten)
from ._errors import GraphError


class Graph(Protocol):
    """What a picture reads from a ``geir.Graph`` (``_core`` imports this module, so it is not imported here)."""

    @property
    def name(self) -> str: ...
    @property
    def inputs(self) -> Sequence[Any]: ...
    @property
    def outputs(self) -> Sequence[Any]: ...
    @property
    def constants(self) -> Mapping[str, Any]: ...
    @property
    def constant_values(self) -> Sequence[Any]: ...
    @property
    def nodes(self) -> Sequence[Any]: ...
    @property
    def symbols(self) -> Any: ...
    def topological_order(self) -> Sequence[Any]: ...


__all__ = ["RENDER_TIMEOUT_S", "graph_to_dot", "name_scope", "render"]

RENDER_TIMEOUT_S = 120
"""Graphviz gets this long to draw a graph (a 1,000-node model takes it some seconds)."""
MAX_SCOPE_DEPTH = 8
"""Clusters nest at most this deep (deeper scopes join their eighth-level ancestor)."""
MIN_CLUSTER = 2
"""A scope holding fewer nodes than this is drawn in its parent's cluster: a box round one node says nothing."""
CONSTANT_ROWS, ATTRIBUTE_ROWS = 6, 4
"""Folded constants and attributes one node's label lists; more are counted ('… 3 more')."""
SYMBOLS_PER_ROW = 6
LONG_EDGE = 32
"""An input from more than this many ranks up is drawn from a reference box beside its consumer, not as a line:
at 1,000 nodes the shared mask and rotary tables would otherwise cross every layer (Graphviz's layout time grows
with the ranks edges span: 52,000 for a 14-layer Llama, 2,400 with the boxes; minutes become seconds)."""


def name_scope(name: str) -> tuple[str, ...]:
    """The module path TorchScript's exporter writes into node names: ``/model/layers.0/self_attn/MatMul_1`` is
    ``('model', 'layers.0', 'self_attn')``; a name without '/' has none."""
    if "/" not in name:
        return ()
    return tuple(p for p in name.split("/")[:-1] if p)[:MAX_SCOPE_DEPTH]


class _Scope:
    __slots__ = ("children", "members", "references", "total")

    def __init__(self) -> None:
        self.children: dict[str, _Scope] = {}
        self.members: list[int] = []
        self.references: list[str] = []
        """DOT lines of the reference boxes drawn here (``LONG_EDGE``)."""
        self.total = 0


def _scope_tree(nodes: Sequence[Any], scopes: Mapping[str, Sequence[str]]
                ) -> tuple[_Scope, list[_Scope], list[tuple[str, ...]]]:
    """The tree of scopes, and each node's scope and path."""
    root = _Scope()
    where: list[_Scope] = []
    paths: list[tuple[str, ...]] = []
    for node in nodes:
        given = scopes.get(node.name)
        path = name_scope(node.name) if given is None else tuple(str(p) for p in given)[:MAX_SCOPE_DEPTH]
        scope = root
        for part in path:
            scope.total += 1
            scope = scope.children.setdefault(part, _Scope())
        scope.total += 1
        scope.members.append(len(where))
        where.append(scope)
        paths.append(path)
    return root, where, paths


def _depths(graph: Graph) -> dict[int, int]:
    """About the rank Graphviz gives each node (by ``id``): its longest path from the inputs, or, when it could
    sit more than LONG_EDGE ranks lower (a shape computed from the inputs for a reshape deep down), just above its
    first consumer, where its long input edges become reference boxes and it is drawn beside what it serves."""
    try:
        order = list(graph.topological_order())
    except GraphError:                      # a cycle: drawn as it is, in the order the graph holds its nodes
        order = list(graph.nodes)
    early: dict[int, int] = {}
    for node in order:
        early[id(node)] = max((early.get(id(v.producer), 0) + 1 for v in node.inputs
                               if v is not None and v.producer is not None), default=0)
    bottom = max(early.values(), default=0) + 1
    late: dict[int, int] = {id(v.producer): bottom for v in graph.outputs if v.producer is not None}
    for node in reversed(order):
        mine = late.get(id(node), early[id(node)] + 1) - 1
        late[id(node)] = mine
        for v in node.inputs:
            if v is not None and v.producer is not None:
                late[id(v.producer)] = min(late.get(id(v.producer), mine), mine)
    return {key: late[key] if late[key] - early[key] > LONG_EDGE else early[key] for key in early}


def _short_name(node: Any) -> str | None:
    """The node's name as its label shows it: the last path component, None when it only repeats the op type
    (``/model/Mul_3``, ``node_Mul_3``); the full name is the tooltip."""
    last = node.name.rsplit("/", 1)[-1]
    if not last or re.fullmatch(rf"(node_)?{re.escape(node.op_type)}(_\d+)?", last, re.IGNORECASE):
        return None
    return shorten(last, 32)


class _Drawing:
    """One graph's DOT text, built in a single pass over nodes and edges."""

    def __init__(self, graph: Graph, scopes: Mapping[str, Sequence[str]]) -> None:
        self.graph = graph
        kept = {d for v in graph.inputs for d in (getattr(v.type, "dims", None) or ()) if isinstance(d, str)}
        canonical = getattr(getattr(graph, "symbols", None), "canonical", None)
        self.symbols = Symbols(kept, canonical)
        outputs = {id(v) for v in graph.outputs}
        used = {id(v) for n in graph.nodes for v in n.inputs if v is not None}
        self.folded = {id(v) for v in graph.constant_values if id(v) not in outputs}
        self.unused = sum(id(v) not in used for v in graph.constant_values if id(v) in self.folded)
        self.source: dict[int, str] = {}
        self.tree, self.where, self.paths = _scope_tree(graph.nodes, scopes)
        self.depth = _depths(graph)
        self.references: dict[tuple[int, int], str] = {}
        self.clusters = 0

    def node_line(self, i: int) -> str:
        node, sym = self.graph.nodes[i], self.symbols
        rows = [f'<B>{html(shorten(node.op_type, 40))}</B>']
        if node.domain not in ("", "ai.onnx"):
            rows.append(f'<FONT POINT-SIZE="8">{html(shorten(node.domain, 40))}</FONT>')
        short = _short_name(node)
        if short is not None:
            rows.append(f'<FONT POINT-SIZE="8" COLOR="#555555">{html(short)}</FONT>')
        lines = attribute_lines(node.attributes.items())
        rows += [f'<FONT POINT-SIZE="8">{html(line)}</FONT>' for line in lines[:ATTRIBUTE_ROWS]]
        if len(lines) > ATTRIBUTE_ROWS:
            rows.append(f'<FONT POINT-SIZE="8">… {len(lines) - ATTRIBUTE_ROWS} more lines of attributes</FONT>')
        folded = [v for v in node.inputs if v is not None and id(v) in self.folded]
        for v in folded[:CONSTANT_ROWS]:
            name = relative_name(v.name, self.paths[i])
            text = constant_text(name, sym.type_text(v.type), self.graph.constants.get(v.name))
            rows.append(f'<FONT POINT-SIZE="8" COLOR="#3d3d8f">{html(text)}</FONT>')
        if len(folded) > CONSTANT_ROWS:
            rows.append(f'<FONT POINT-SIZE="8" COLOR="#3d3d8f">… {len(folded) - CONSTANT_ROWS} more constants</FONT>')
        table = "".join(f"<TR><TD>{r}</TD></TR>" for r in rows)
        label = f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">{table}</TABLE>>'
        tooltip = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        return f"n{i} [label={label}, tooltip={quoted(tooltip + ' ' + repr(node.name))}, " \
               f"{node_style(node.domain, node.op_type)}];"

    def clustered(self, scope: _Scope, indent: str, out: list[str]) -> None:
        """``scope``'s nodes and its sub-scopes as nested clusters; a chain of single sub-scopes is one cluster
        (``model/layers.0``), and a scope of fewer than MIN_CLUSTER nodes joins its parent."""
        for part, child in scope.children.items():
            parts = [part]
            while not child.members and len(child.children) == 1:
                (part, child), = child.children.items()
                parts.append(part)
            if child.total < MIN_CLUSTER:
                self.flat(child, indent, out)
                continue
            self.clusters += 1
            out.append(f"{indent}subgraph cluster_{self.clusters} {{")
            out.append(f"{indent}  label={quoted(shorten('/'.join(parts), 60))}; tooltip={quoted('/'.join(parts))};")
            self.clustered(child, indent + "  ", out)
            out.append(f"{indent}}}")
        out.extend(indent + self.node_line(i) for i in scope.members)
        out.extend(indent + line for line in scope.references)

    def flat(self, scope: _Scope, indent: str, out: list[str]) -> None:
        out.extend(indent + self.node_line(i) for i in scope.members)
        out.extend(indent + line for line in scope.references)
        for child in scope.children.values():
            self.flat(child, indent, out)

    def edge(self, value: Any, target: str, source: str | None = None) -> str:
        return f"{source or self.source[id(value)]} -> {target} [label={quoted(self.symbols.type_text(value.type))}, " \
               f"tooltip={quoted(value.name)}];"

    def input_edge(self, value: Any, i: int) -> str:
        """The edge into node ``i``; from a reference box beside it when the value comes from more than LONG_EDGE
        ranks up (a line across the whole picture costs Graphviz minutes at 1,000 nodes and the reader the thread)."""
        producer = value.producer
        start = self.depth.get(id(producer), 0) if producer is not None else -1
        if self.depth.get(id(self.graph.nodes[i]), 0) - start <= LONG_EDGE:
            return self.edge(value, f"n{i}")
        scope = self.where[i]
        key = (id(value), id(scope))
        if key not in self.references:
            self.references[key] = ref = f"r{len(self.references)}"
            origin = f"from {producer.op_type}" if producer is not None else "graph input"
            label = f"{shorten(value.name, 40)}\n{origin}"
            where = f"{value.name} from " + (f"{producer.op_type} {producer.name!r}" if producer else "the inputs")
            scope.references.append(f'{ref} [style="rounded,dashed", color="#888888", fontsize=8, '
                                    f"label={quoted(label)}, tooltip={quoted(where)}];")
        return self.edge(value, f"n{i}", self.references[key])

    def text(self) -> str:
        graph = self.graph
        body: list[str] = []
        for i, value in enumerate(graph.inputs):
            self.source[id(value)] = f"in{i}"
            label = f"{shorten(value.name, 48)}\n{self.symbols.type_text(value.type)}"
            body.append(f'  in{i} [shape=ellipse, style=filled, fillcolor="#e8f0fe", label={quoted(label)}, '
                        f"tooltip={quoted(value.name)}];")
        for i, value in enumerate(graph.constant_values):
            if id(value) not in self.folded:           # a constant the graph returns: drawn, as it has no consumer
                self.source[id(value)] = f"c{i}"
                label = f"{shorten(value.name, 48)}\n{self.symbols.type_text(value.type)}"
                body.append(f"  c{i} [shape=box, style=dashed, label={quoted(label)}, tooltip={quoted(value.name)}];")
        for i, node in enumerate(graph.nodes):
            for value in node.outputs:
                if value is not None:
                    self.source[id(value)] = f"n{i}"
        edges = [f"  {self.input_edge(v, i)}" for i, node in enumerate(graph.nodes) for v in node.inputs
                 if v is not None and id(v) not in self.folded]
        self.clustered(self.tree, "  ", body)
        body += edges
        for i, value in enumerate(graph.outputs):
            body.append(f"  out{i} [shape=ellipse, peripheries=2, label={quoted(shorten(value.name, 48))}, "
                        f"tooltip={quoted(value.name)}];")
            body.append(f"  {self.edge(value, f'out{i}')}")
        head = [f"digraph {quoted(graph.name)} {{",
                '  graph [rankdir=TB, newrank=true, nodesep=0.2, ranksep=0.3, fontname="Helvetica", fontsize=11,'
                ' style="rounded,filled", fillcolor="#f7f7f7", color="#bbbbbb", labeljust=l];',
                '  node [shape=box, fontname="Helvetica", fontsize=10, height=0.3, margin="0.08,0.03"];',
                '  edge [fontname="Helvetica", fontsize=8, fontcolor="#444444", color="#666666", arrowsize=0.6];']
        return "\n".join(head + body + [self.legend(), "}"]) + "\n"

    def legend(self) -> str:
        """The graph's caption (top left): its name and counts, the colour key and the abbreviated symbols."""
        graph = self.graph
        ours = sum(n.domain == OUR_DOMAIN for n in graph.nodes)
        counts = f"{len(graph.nodes)} nodes ({ours} {OUR_DOMAIN})"
        if self.folded:
            counts += f", {len(self.folded) - self.unused} constants shown in their consumers' boxes"
        title = f"<B>{html(shorten(graph.name, 60))}</B>  {html(counts)}"
        rows = [f'<TR><TD ALIGN="LEFT" COLSPAN="{len(LEGEND)}">{title}</TD></TR>']
        rows.append("<TR>" + "".join(f'<TD BGCOLOR="{c}" BORDER="1">{k}</TD>' for k, c in LEGEND) + "</TR>")
        entries = self.symbols.legend()
        for at in range(0, len(entries), SYMBOLS_PER_ROW):
            cells = "".join(f'<TD ALIGN="LEFT">{html(shorten(e, 40))}</TD>' for e in entries[at:at + SYMBOLS_PER_ROW])
            rows.append(f"<TR>{cells}</TR>")
        table = f'<TABLE BORDER="0" CELLSPACING="2" CELLPADDING="2">{"".join(rows)}</TABLE>'
        return f"  label=<{table}>; labelloc=t;"


def graph_to_dot(graph: Graph, scopes: Mapping[str, Sequence[str]] | None = None) -> str:
    """The DOT text of ``graph``. ``scopes``: a module path per node name, where the names hold none (the dynamo
    exporter's; ``tools.model_scopes`` reads them from a file); other nodes are clustered by their name's
    '/'-separated prefix."""
    return _Drawing(graph, scopes or {}).text()


def render(graph: Graph, fmt: str, scopes: Mapping[str, Sequence[str]] | None = None,
           notes: list[str] | None = None) -> bytes:
    """SVG or PNG bytes of ``graph`` drawn by Graphviz; GraphError when ``dot`` is missing or fails. What Graphviz
    warns of while succeeding is appended to ``notes`` (a PNG over its bitmap limit of 32,767 pixels is scaled
    down to fit: a 1,000-node model's PNG is, its SVG is not)."""
    if fmt not in ("svg", "png"):
        raise GraphError(f"render: format: expected svg or png, got {fmt!r}")
    dot = shutil.which("dot")
    if dot is None:
        raise GraphError(f"drawing {fmt.upper()} needs Graphviz's 'dot' on PATH (Debian: apt-get install graphviz); "
                         "the DOT text (format dot) needs nothing")
    text = graph_to_dot(graph, scopes).encode("utf-8", errors="replace")
    try:
        result = subprocess.run([dot, f"-T{fmt}"], input=text, capture_output=True, timeout=RENDER_TIMEOUT_S,
                                check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GraphError(f"Graphviz 'dot' failed to draw graph '{graph.name}': {exc}") from None
    if result.returncode != 0 or not result.stdout:
        message = result.stderr.decode(errors="replace").strip().splitlines()[:1] or [f"exit status {result.returncode}"]
        raise GraphError(f"Graphviz 'dot' failed to draw graph '{graph.name}': {message[0]}")
    if notes is not None:
        notes += [line.strip() for line in result.stderr.decode(errors="replace").splitlines() if line.strip()][:5]
    return result.stdout
