"""The import graph: no cycle between graphmax's modules (imports inside functions included), every import points
down the layers (pipelines → gm_solver → gm_graphs; inside gm_graphs build → graph → format → powers → count →
tokenize → corpus → store → errors), and no module imports another module's private (``_``) name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gm_graphs", "gm_solver", "pipelines")
# top to bottom; a module may import its own layer's modules (without a cycle) and those of the layers below
LAYERS = ("pipelines", "gm_solver", "gm_graphs", "gm_graphs.build", "gm_graphs.graph", "gm_graphs.format",
          "gm_graphs.powers", "gm_graphs.count", "gm_graphs.tokenize", "gm_graphs.corpus", "gm_graphs.store",
          "gm_graphs.errors")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """The index in LAYERS of the longest prefix naming ``module``'s layer (gm_graphs itself: the package's
    facade, above its layers)."""
    best = None
    for i, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(LAYERS[best]):
                best = i
    assert best is not None, module
    return best


def imports(root: Path) -> dict[str, list[tuple[str, str, int]]]:
    """Each module's imports of graphmax modules: (imported module, name imported or "", line)."""
    modules = {module_name(p, root): p for package in PACKAGES for p in (root / package).rglob("*.py")}
    found: dict[str, list[tuple[str, str, int]]] = {}
    for module, path in modules.items():
        edges = found.setdefault(module, [])
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] in PACKAGES]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] not in PACKAGES:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.append((sub, "", node.lineno) if sub in modules else (target, alias.name, node.lineno))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def problems(root: Path) -> list[str]:
    found = imports(root)
    out = []
    graph: dict[str, set[str]] = {}
    for module, edges in found.items():
        for target, name, line in edges:
            if target != module:
                graph.setdefault(module, set()).add(target)
            if layer(target) < layer(module):
                out.append(f"{module}:{line} imports {target}, a layer above it")
            if name.startswith("_") and not name.startswith("__"):
                out.append(f"{module}:{line} imports {target}.{name}, a private name")
    out += [f"import cycle: {' ⇄ '.join(c)}" for c in cycles(graph)]
    return out


def test_graphmax_imports_point_down_without_cycles():
    assert problems(ROOT) == []


@pytest.mark.parametrize("source, expected", [
    ({"gm_graphs/count/a.py": "def f():\n    from gm_graphs.count import b\n",
      "gm_graphs/count/b.py": "import gm_graphs.count.a\n"},
     "import cycle: gm_graphs.count.a ⇄ gm_graphs.count.b"),
    ({"gm_graphs/store/a.py": "from gm_graphs.format.b import x\n", "gm_graphs/format/b.py": "x = 1\n"},
     "gm_graphs.store.a:1 imports gm_graphs.format.b, a layer above it"),
    ({"gm_solver/a.py": "from pipelines.b import x\n", "pipelines/b.py": "x = 1\n"},
     "gm_solver.a:1 imports pipelines.b, a layer above it"),
    ({"gm_solver/a.py": "from .b import _x\n", "gm_solver/b.py": "_x = 1\n"},
     "gm_solver.a:1 imports gm_solver.b._x, a private name"),
    ({"gm_graphs/format/a.py": "from gm_graphs import Graph\n", "gm_graphs/__init__.py": "Graph = 1\n"},
     "gm_graphs.format.a:1 imports gm_graphs, a layer above it"),
])
def test_each_kind_of_bad_import_is_found(tmp_path, source, expected):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for rel, text in source.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert expected in problems(tmp_path)
