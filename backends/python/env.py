"""Triton's `EXECUTION_ENV_PATH` model parameter: a packed Python environment (conda-pack or
venv-pack tarball, `.tar.gz` / `.tar`) a model's stub process runs in.

`$$TRITON_MODEL_DIRECTORY` in the path is the model's folder; a relative path is relative to
it. The tarball is unpacked once into a cache folder (`$PIER_PYTHON_ENV_CACHE`, else
`$XDG_CACHE_HOME/pier/python-envs`, else `~/.cache/pier/python-envs`), keyed by the tarball's
path, size and modification time: loads, reloads, instances and restarts reuse it, and a new
tarball unpacks afresh. A conda-pack environment's `bin/conda-unpack` runs once after unpacking.

What the environment needs (as Triton asks the stub's Python version to match): its
`bin/python` must be the server's Python version (X.Y), because the stub's code and its
compiled dependencies are the server's. The stub finds Pier's own code, and any of numpy,
msgspec that the environment lacks, in the server's installation: those folders are appended
after the environment's own site-packages, so a package the environment has always wins.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

import msgspec
import numpy as np

from pier.backends.python.process import StubCommand
from pier.contract.errors import PierError, invalid_arg, unavailable

ENV_PARAMETER = "EXECUTION_ENV_PATH"
_MARKER = ".pier-unpacked"
_lock = threading.Lock()
_BOOTSTRAP = ("import sys; sys.path.extend({paths!r}); "
              "from pier.backends.python.stub import main; main(sys.argv[1:])")


def cache_root() -> Path:
    if os.environ.get("PIER_PYTHON_ENV_CACHE"):
        return Path(os.environ["PIER_PYTHON_ENV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pier" / "python-envs"


def tarball_path(raw: str, model_dir: Path) -> Path:
    path = Path(raw.replace("$$TRITON_MODEL_DIRECTORY", str(model_dir)))
    return path if path.is_absolute() else model_dir / path


def _stub_paths() -> list[str]:
    """Folders the stub needs from the server's installation: the one holding `pier`, then those of
    its dependencies (appended to the environment's sys.path)."""
    here = Path(os.path.abspath(__file__))  # .../pier/backends/python/env.py (not resolved: links stay)
    paths = [str(here.parents[3])]
    for module in (np, msgspec):
        folder = str(Path(os.path.abspath(module.__file__ or "")).parent.parent)
        if folder not in paths:
            paths.append(folder)
    return paths


def _python_of(env: Path) -> Path:
    for name in ("bin/python3", "bin/python"):
        if (env / name).exists():
            return env / name
    raise unavailable(f"the environment unpacked from {ENV_PARAMETER} into {env} has no bin/python3 or bin/python")


def _unpack(tarball: Path, target: Path) -> None:
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=root))
    try:
        with tarfile.open(tarball) as tar:
            if hasattr(tarfile, "tar_filter"):
                tar.extractall(scratch, filter="tar")
            else:  # pragma: no cover - Python without extraction filters
                tar.extractall(scratch)
        entries = list(scratch.iterdir())
        top = entries[0] if len(entries) == 1 and entries[0].is_dir() and not (scratch / "bin").exists() else scratch
        python = _python_of(top)
        probe = subprocess.run([str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=60)
        version = probe.stdout.strip() or "?"
        conda = (top / "bin" / "conda-unpack").exists()
        if not conda:  # complete before it gets its name: a reader never sees half of it
            (top / _MARKER).write_text(version)
        if target.exists():  # a half-done unpack (no marker) from an earlier run
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(top, target)
        except OSError:
            if not (target / _MARKER).exists():
                raise
            return  # another server unpacked it meanwhile
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if conda:  # conda-pack: rewrite the prefixes for the new place, then mark it complete
        subprocess.run([str(_python_of(target)), str(target / "bin" / "conda-unpack")], check=True,
                       capture_output=True, timeout=600)
        (target / _MARKER).write_text(version)


def launch_for(raw: str, model: str, model_dir: Path) -> StubCommand:
    """The stub command for a model whose EXECUTION_ENV_PATH is `raw` (unpacking it if needed)."""
    tarball = tarball_path(raw, model_dir)
    if not tarball.is_file():
        raise invalid_arg(f"model '{model}': {ENV_PARAMETER} {tarball} is not a file")
    st = tarball.stat()
    key = hashlib.sha256(f"{tarball.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    stem = tarball.name.split(".")[0] or "env"
    target = cache_root() / f"{stem}-{key}"
    with _lock:
        if not (target / _MARKER).exists():
            try:
                _unpack(tarball, target)
            except PierError:
                raise
            except Exception as exc:
                raise unavailable(f"model '{model}': cannot unpack {ENV_PARAMETER} {tarball}: "
                                  f"{type(exc).__name__}: {exc}") from None
    version = (target / _MARKER).read_text().strip()
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if version != ours:
        raise unavailable(f"model '{model}': the Python of {ENV_PARAMETER} {tarball} is {version}, the server's is "
                          f"{ours}: the stub process needs the same Python version (see docs)")
    python = _python_of(target)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{target / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["LD_LIBRARY_PATH"] = f"{target / 'lib'}{os.pathsep}{env['LD_LIBRARY_PATH']}" \
        if env.get("LD_LIBRARY_PATH") else str(target / "lib")
    env["PYTHONUNBUFFERED"] = "1"
    return StubCommand((str(python), "-c", _BOOTSTRAP.format(paths=_stub_paths())), env)
