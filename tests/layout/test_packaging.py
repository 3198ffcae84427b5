"""One installed name: the folders server/ and backends/ install as `pier` and `pier.backends`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _folder_packages() -> set[str]:
    found = set()
    for folder, root in (("server", "pier"), ("backends", "pier.backends")):
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((root, *init.parent.relative_to(ROOT / folder).parts)))
    return found


def test_every_package_folder_is_listed_in_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml with the standard library")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"pier": "server", "pier.backends": "backends"}
    listed = set(config["packages"])
    data_only = {p for p in listed if p.endswith(".csrc")}  # C++ sources, no __init__.py
    assert listed - data_only == _folder_packages()


def test_only_pier_is_importable_outside_the_checkout(tmp_path: Path) -> None:
    code = (
        "import importlib.util as u, pier, pier.contract.backend\n"
        "print(u.find_spec('server'), u.find_spec('backends'), pier.__name__, pier.contract.backend.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None", "pier", "pier.contract.backend"]


def test_python_dash_m_pier_runs_the_cli(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pier", "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout


def test_no_module_imports_the_folder_names() -> None:
    """`import server...` / `import backends...` would load a second copy of modules that hold state."""
    offenders = []
    for folder in ("server", "backends", "tests", "bench", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                words = line.split()
                if len(words) >= 2 and words[0] in ("import", "from") and words[1].split(".")[0] in (
                        "server", "backends"):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
