"""The layers, read from the source with `ast` (every import, in functions too).

Folders, top to bottom (an arrow may only point down; a folder may skip layers):

    entry points (pier.cli, pier.app, pier.model_cli, pier.__main__)
    frontends -> dataplane -> control -> lifecycle -> {scheduling, repository}
              -> {ipc, observability, tensors} -> {contract, protocol, settings}

    pier.backends.<name> -> {contract, ipc}   (the server reaches a backend only by name)

- `pier.contract` imports no other module of Pier; `pier.ipc` imports only the contract;
- a backend imports only the contract, `pier.ipc` and its own folder;
- the server never imports a backend (repository.backend_registry loads them by name, lazily);
- no import cycles between modules, and none between folders (the rule above makes the folder
  graph a DAG; `test_no_package_cycles` checks it directly as well).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"pier.app", "pier.cli", "pier.model_cli", "pier.__main__"}
# Each server folder's layer: a module may import a module of a strictly lower layer, or of its
# own folder. `pier` (the version) and `pier.settings` (typed settings, built once by the CLI and
# passed down) import nothing of Pier, so every layer may read them.
LAYERS: dict[str, int] = {
    "pier": 0, "pier.settings": 0, "pier.contract": 0, "pier.protocol": 0,
    "pier.ipc": 1, "pier.observability": 1, "pier.tensors": 1,
    "pier.scheduling": 2, "pier.repository": 2,
    "pier.lifecycle": 3,
    "pier.control": 4,
    "pier.dataplane": 5,
    "pier.frontends": 6,
    **{name: 7 for name in ENTRY_POINTS},
}


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


def test_ipc_imports_only_the_contract() -> None:
    assert any(_in(m, "pier.ipc") for m in MODULES)
    assert not _violations(lambda m, i: not _in(m, "pier.ipc") or _in(i, "pier.contract") or _in(i, "pier.ipc"))


def test_a_backend_imports_only_the_contract_ipc_and_its_own_folder() -> None:
    def ok(m: str, i: str) -> bool:
        if not _in(m, "pier.backends"):
            return True
        own = ".".join(m.split(".")[:3])  # pier.backends.<name>
        return _in(i, "pier.contract") or _in(i, "pier.ipc") or _in(i, own)
    assert not _violations(ok)


def test_the_server_never_imports_a_backend() -> None:
    assert not _violations(lambda m, i: _in(m, "pier.backends") or not _in(i, "pier.backends"))


def test_only_frontends_and_the_entry_points_import_frontends() -> None:
    assert not _violations(lambda m, i: not _in(i, "pier.frontends") or _in(m, "pier.frontends")
                           or m in ENTRY_POINTS)


def package(module: str) -> str:
    """The folder a module belongs to: pier.<folder>, pier.backends.<name>, or a root module."""
    parts = module.split(".")
    if parts[:2] == ["pier", "backends"]:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


PACKAGE_GRAPH: dict[str, set[str]] = {}
for _m, _deps in GRAPH.items():
    PACKAGE_GRAPH.setdefault(package(_m), set()).update(package(d) for d in _deps if package(d) != package(_m))


def test_every_server_folder_has_a_layer() -> None:
    server = {package(m) for m in MODULES if not _in(m, "pier.backends")}
    assert not server - LAYERS.keys(), f"give these a layer in LAYERS: {sorted(server - LAYERS.keys())}"


def test_server_imports_point_down_the_layers() -> None:
    def ok(m: str, i: str) -> bool:
        a, b = package(m), package(i)
        if a == b or a not in LAYERS or b not in LAYERS or a in ENTRY_POINTS and b in ENTRY_POINTS:
            return True  # the backend rules above cover pier.backends
        return LAYERS[b] < LAYERS[a]
    assert not _violations(ok)


def test_no_package_cycles() -> None:
    assert not _cycles(PACKAGE_GRAPH)


def test_no_import_cycles() -> None:
    assert not _cycles(GRAPH)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: any with two or more modules is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
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

    for v in graph:
        if v not in index:
            visit(v)
    return cycles
