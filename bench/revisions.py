"""An older revision of Pier, beside the checkout: a git worktree of it, and its server started
the way that revision starts: before the package was named `pier`, `python -m server` with the
worktree on PYTHONPATH; since, `python -m pier` with a folder of links that lays the worktree out as
pyproject.toml installs it (old_pier_path). bench/ab.py compares it with the current code."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.common import ROOT, log
from bench.servers import Server, start_pier


def git(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A detached worktree of `rev` in a temporary folder outside the checkout, removed at the end."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    parent = Path(tempfile.mkdtemp(prefix="pier-ab-"))
    tree = parent / "old"
    log(f"git worktree add --detach {tree} {rev} ({sha[:12]})")
    try:
        git("worktree", "add", "--detach", str(tree), sha, timeout=300)
        yield tree
    finally:
        log(f"git worktree remove --force {tree}")
        try:
            if tree.exists():
                git("worktree", "remove", "--force", str(tree))
        except Exception as exc:  # still remove the folder and the worktree's record
            log(f"worktree remove failed: {exc}")
            with contextlib.suppress(Exception):
                shutil.rmtree(tree, ignore_errors=True)
                git("worktree", "prune")
        shutil.rmtree(parent, ignore_errors=True)


def old_pier_path(tree: Path, into: Path) -> Path:
    """A folder to put first on PYTHONPATH so that `python -m pier` runs the checkout `tree` (another
    revision): `pier` is a folder of links to its server/ files, with backends/ as `pier.backends`
    (the layout pyproject.toml installs)."""
    pkg = into / "pier"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (tree / "server").iterdir():
        if not (pkg / entry.name).exists():
            (pkg / entry.name).symlink_to(entry)
    if not (pkg / "backends").exists():
        (pkg / "backends").symlink_to(tree / "backends")
    return into


def _is_pier_package(tree: Path) -> bool:
    """Whether the revision installs server/ as `pier` (its modules import `pier.*`)."""
    return '"pier" = "server"' in (tree / "pyproject.toml").read_text()


def _old_env(tree: Path) -> dict[str, str]:
    if _is_pier_package(tree):  # the links live beside the worktree; kernels compiled apart from ours
        return {**os.environ, "PYTHONPATH": str(old_pier_path(tree, tree.parent / "links")),
                "TORCH_EXTENSIONS_DIR": str(tree.parent / "torch_extensions")}
    return {**os.environ, "PYTHONPATH": str(tree)}


def check_old_imports(tree: Path) -> None:
    """The old command must run the worktree's code, not this checkout's (or the installed pier)."""
    names = ("pier", "pier.backends") if _is_pier_package(tree) else ("server", "backends")
    code = f"import {', '.join(names)}; " + "; ".join(f"print({n}.__file__)" for n in names)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=_old_env(tree), capture_output=True,
                          text=True, timeout=120)
    files = proc.stdout.split()
    if proc.returncode != 0 or len(files) != 2 or not all(Path(f).resolve().is_relative_to(tree.resolve())
                                                          for f in files):
        raise RuntimeError(f"the old revision's {' / '.join(names)} do not import from {tree}: "
                           f"{(proc.stdout + proc.stderr).strip()[-800:]}")


def start_old(name: str, tree: Path, repo: Path, *extra: str, timeout: float = 120) -> Server:
    """The old worktree's server (`python -m pier` or, before the package was `pier`, `python -m
    server`), with start_pier's flags (and `extra`), on free ports."""
    module = "pier" if _is_pier_package(tree) else "server"
    return start_pier(name, repo, *extra, timeout=timeout, command=[sys.executable, "-m", module], cwd=tree,
                      env=_old_env(tree))


def describe_head() -> str:
    try:
        return git("describe", "--always", "--dirty", timeout=10)
    except Exception:
        return "?"
