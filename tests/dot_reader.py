"""A small reader of the DOT text ``geir show --format dot`` writes, by DOT's grammar (quoted strings with their
escapes, HTML strings, attribute lists, nested subgraphs): what the picture tests check the text with, rather than
matching the writer's own formatting. It fails on text Graphviz would not read (an unterminated string, a raw
newline in one, unbalanced braces)."""

from __future__ import annotations

import html
import re


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) tokens: 'id', 'str' (a quoted string, unescaped), 'html' (an HTML string's inside), or the
    punctuation itself. Fails on anything DOT would not read (an unterminated string, a raw newline in one)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("->", i):
            out.append(("->", "->"))
            i += 2
        elif c in "{}[];,=":
            out.append((c, c))
            i += 1
        elif c == '"':
            j, chars = i + 1, []
            while text[j] != '"':
                assert text[j] != "\n", f"raw newline in a quoted string at {i}"
                if text[j] == "\\":
                    chars.append({"n": "\n", "\\": "\\", '"': '"'}.get(text[j + 1], "\\" + text[j + 1]))
                    j += 2
                else:
                    chars.append(text[j])
                    j += 1
            out.append(("str", "".join(chars)))
            i = j + 1
        elif c == "<":
            depth, j = 1, i + 1
            while depth:
                depth += {"<": 1, ">": -1}.get(text[j], 0)
                j += 1
            out.append(("html", text[i + 1:j - 1]))
            i = j
        else:
            m = re.compile(r"[A-Za-z0-9_.#]+").match(text, i)
            assert m, f"unexpected {text[i:i + 20]!r}"
            out.append(("id", m.group()))
            i = m.end()
    return out


class Dot:
    """What the DOT text says: node statements (id -> attributes, enclosing cluster labels), edges, graph name."""

    def __init__(self, text: str) -> None:
        tokens = _tokens(text)
        assert tokens[0] == ("id", "digraph") and tokens[2] == ("{", "{") and tokens[-1] == ("}", "}")
        self.name = tokens[1][1]
        self.nodes: dict[str, dict[str, str]] = {}
        self.where: dict[str, tuple[str, ...]] = {}
        self.edges: list[tuple[str, str, dict[str, str]]] = []
        self.graph: dict[str, str] = {}
        stack: list[str] = []
        i = 3
        while i < len(tokens) - 1:
            kind, value = tokens[i]
            if kind == "id" and value == "subgraph":
                assert tokens[i + 1][1].startswith("cluster_") and tokens[i + 2][0] == "{"
                stack.append("")
                i += 3
            elif kind == "}":
                stack.pop()
                i += 1
            elif kind == ";":
                i += 1
            elif kind == "id" and tokens[i + 1][0] == "=":             # label=...; inside a (sub)graph
                if stack and value == "label":
                    stack[-1] = tokens[i + 2][1]
                elif not stack:
                    self.graph[value] = tokens[i + 2][1]
                i += 3
            elif kind == "id" and tokens[i + 1][0] == "->":
                target = tokens[i + 2][1]
                attrs, i = self._attrs(tokens, i + 3)
                self.edges.append((value, target, attrs))
            elif kind == "id" and tokens[i + 1][0] == "[":
                attrs, i = self._attrs(tokens, i + 1)
                if value not in ("graph", "node", "edge"):
                    assert value not in self.nodes, f"node {value} declared twice"
                    self.nodes[value], self.where[value] = attrs, tuple(stack)
            else:
                raise AssertionError(f"unexpected token {tokens[i]} at {i}")
        assert not stack, "unbalanced subgraph braces"

    @staticmethod
    def _attrs(tokens: list[tuple[str, str]], i: int) -> tuple[dict[str, str], int]:
        assert tokens[i][0] == "[", tokens[i]
        attrs, i = {}, i + 1
        while tokens[i][0] != "]":
            key, eq, value = tokens[i], tokens[i + 1], tokens[i + 2]
            assert key[0] == "id" and eq[0] == "=", (key, eq)
            attrs[key[1]] = value[1]
            i += 4 if tokens[i + 3][0] == "," else 3
        return attrs, i + 1

    def html_text(self, node: str) -> str:
        """The visible text of a node's HTML label (tags dropped, entities decoded); only our few tags allowed."""
        label = self.nodes[node]["label"]
        tags = re.findall(r"</?([A-Za-z]+)[^<>]*>", label)
        assert set(tags) <= {"TABLE", "TR", "TD", "FONT", "B"}, tags
        return html.unescape(re.sub(r"<[^<>]*>", "\n", label))

    def caption(self) -> list[str]:
        """The lines of the graph's caption (its HTML label: name, counts, colour key, symbol legend)."""
        return [line for line in html.unescape(re.sub(r"<[^<>]*>", "\n", self.graph["label"])).splitlines() if line]

    def op_nodes(self) -> dict[str, str]:
        """Node id -> its tooltip, for the op nodes (n0, n1, ...)."""
        return {k: a["tooltip"] for k, a in self.nodes.items() if re.fullmatch(r"n\d+", k)}

    def node_named(self, name: str) -> str:
        (found,) = [k for k, tip in self.op_nodes().items() if tip.endswith(" " + repr(name))]
        return found
