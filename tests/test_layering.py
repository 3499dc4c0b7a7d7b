"""The layering rule of design.md, measured on the code's own imports: ir < schemas < passes < runtimes < tools <
the package facade. No module imports a higher layer (not even inside a function), and no modules import each
other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).parents[1]
LAYERS = ("ir", "schemas", "passes", "runtimes", "tools")
"""From the ground floor up; the root's ``__init__``/``__main__`` (the facade) stand above them all."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["geir", *parts])


def _package_of(path: Path) -> list[str]:
    name = _module_name(path).split(".")
    return name if path.name == "__init__.py" else name[:-1]


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The geir modules ``path`` imports (``from .x import y`` counts module ``x``, and ``x.y`` when that is a
    module of the package)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(path)
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "geir" or module.startswith("geir."):
                found.add(module)
                found.update(f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name == "geir" or a.name.startswith("geir."))
    return {m for m in found if m in MODULES}


# examples/ holds user scripts run from the checkout (no __init__.py: not a package, not in the wheel), not modules;
# setup.py and pytest_geir.py (the pytest plugin, a top-level module of its own) sit at the root but are not geir's
SOURCES = [p for p in ROOT.rglob("*.py") if not {"tests", "examples", ".venv", "build"} & set(p.relative_to(ROOT).parts)
           and not p.relative_to(ROOT).parts[0].startswith(".") and p.relative_to(ROOT).as_posix() not in
           ("setup.py", "pytest_geir.py")]
MODULES = {_module_name(p): p for p in SOURCES}


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return len(LAYERS)
    return LAYERS.index(parts[1])


def test_every_module_belongs_to_a_layer():
    assert {m.split(".")[1] for m in MODULES if "." in m} <= set(LAYERS) | {"__main__"}


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    upward = [f"{module} -> {target}" for module, path in MODULES.items() for target in _imports(path, False)
              if _layer(target) > _layer(module)]
    assert upward == []


def test_no_modules_import_each_other_in_a_circle():
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        for target in _imports(path, True):
            # a package imports its own submodules to hand their names on; that is not a circle of design
            if not target.startswith(module + ".") and target != module:
                graph.add_edge(module, target)
    assert list(nx.simple_cycles(graph)) == []


def test_folders_do_not_import_each_other_in_a_circle():
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        for target in _imports(path, False):
            a, b = module.split(".")[:3], target.split(".")[:3]
            if a != b:
                graph.add_edge(".".join(a[:2]), ".".join(b[:2]))
    graph.remove_edges_from(nx.selfloop_edges(graph))
    assert list(nx.simple_cycles(graph)) == []
