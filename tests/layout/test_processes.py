"""pier.ipc's supervisors are the only code that starts, watches and restarts child processes:
no module of server/ or backends/ but pier.ipc.child (whose spawn() they call) forks, spawns a
long-lived process, opens a pidfd or waits for a pid (read with `ast`). A short command that is
run and waited for (subprocess.run: the Python backend's probe of a packed environment's
interpreter) is not a child it supervises."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPERVISOR = ROOT / "server" / "ipc" / "child.py"  # spawn(), which only the supervisors call
SPAWNING = {("subprocess", "Popen"), ("os", "fork"), ("os", "forkpty"), ("os", "posix_spawn"),
            ("os", "posix_spawnp"), ("os", "spawnv"), ("os", "spawnl"), ("os", "pidfd_open"), ("os", "waitpid"),
            ("os", "wait"), ("asyncio", "create_subprocess_exec"), ("asyncio", "create_subprocess_shell")}
MODULES = {"multiprocessing", "concurrent.futures.process"}


def _spawns(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (node.value.id, node.attr) in SPAWNING:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in {m for m, _ in SPAWNING} \
                and any((node.module, a.name) in SPAWNING for a in node.names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} import {n}" for n in names
                      if any(n == m or n.startswith(m + ".") for m in MODULES)]
    return found


def test_only_the_supervisor_starts_child_processes() -> None:
    files = [p for folder in ("server", "backends") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert _spawns(SUPERVISOR), "the supervisor itself should be seen spawning (the check would be blind)"
    assert [hit for p in files if p != SUPERVISOR for hit in _spawns(p)] == []
