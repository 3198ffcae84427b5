"""The layers, read from the source with `ast` (every import, in functions too):

    pier.contract  <-  the server (pier.*)      pier.contract  <-  pier.backends.<name>

- `pier.contract` imports no other module of Pier;
- a backend imports only the contract and its own folder;
- the server never imports a backend (backend_registry loads them by name, lazily);
- frontends call the data plane, never the reverse: only frontends and the composition root
  (pier.app) import pier.frontends;
- no import cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSITION_ROOTS = {"pier.app"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, root in (("server", "pier"), ("backends", "pier.backends")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((root, *parts))] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Pier modules `name` imports (`from a import b` counts a, and a.b when it is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(rule) -> list[str]:
    return [f"{m} imports {i}" for m, deps in sorted(GRAPH.items()) for i in sorted(deps) if not rule(m, i)]


def test_the_contract_imports_nothing_else_of_pier() -> None:
    assert any(_in(m, "pier.contract") for m in MODULES)
    assert not _violations(lambda m, i: not _in(m, "pier.contract") or _in(i, "pier.contract"))


def test_a_backend_imports_only_the_contract_and_its_own_folder() -> None:
    def ok(m: str, i: str) -> bool:
        if not _in(m, "pier.backends"):
            return True
        own = ".".join(m.split(".")[:3])  # pier.backends.<name>
        return _in(i, "pier.contract") or _in(i, own)
    assert not _violations(ok)


def test_the_server_never_imports_a_backend() -> None:
    assert not _violations(lambda m, i: _in(m, "pier.backends") or not _in(i, "pier.backends"))


def test_only_frontends_and_the_composition_root_import_frontends() -> None:
    assert not _violations(lambda m, i: not _in(i, "pier.frontends") or _in(m, "pier.frontends")
                           or m in COMPOSITION_ROOTS)


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components: any with two or more modules is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles
