"""Where the upstream sources are (bare git mirrors or plain checkouts) and copying what the suites need."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

# (env var holding the location, default location, env var for the ref, default ref)
SOURCES = {
    "server": ("TRITON_QA_SERVER_GIT", "/work/.mirror/triton-inference-server+server/repo", "TRITON_QA_SERVER_REF",
               "v2.51.0"),
    "client": ("TRITON_QA_CLIENT_GIT", "/work/.mirror/triton-inference-server+client/repo", "TRITON_QA_CLIENT_REF",
               "r24.10"),
    "python_backend": ("TRITON_QA_PYBACKEND_GIT", "/work/.mirror/triton-inference-server+python_backend/repo",
                       "TRITON_QA_PYBACKEND_REF", "r24.10"),
}

SERVER_PATHS = ["qa/common", "qa/python_models/execute_delayed_model", "qa/custom_models/custom_zero_1_float32",
                "src/test/models/repeat_int32/config.pbtxt"]
SUITE_DIRS = ["L0_http", "L0_grpc", "L0_input_validation", "L0_parameters", "L0_shared_memory", "L0_optional_input",
              "L0_simple_ensemble", "L0_decoupled", "L0_grpc_state_cleanup", "L0_model_namespacing", "L0_logging"]


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def locate() -> dict[str, Path] | str:
    """{name: location}, or a message naming what is missing and the variable to set."""
    found, missing = {}, []
    for name, (var, default, _, _) in SOURCES.items():
        path = Path(os.environ.get(var, default))
        if path.is_dir():
            found[name] = path
        else:
            missing.append(f"{path} (set {var})")
    return found if not missing else ", ".join(missing)


def _ref(git_dir: Path, ref: str) -> str:
    for cand in (ref, f"refs/tags/{ref}", f"refs/heads/{ref}", f"origin/{ref}", f"refs/remotes/origin/{ref}"):
        ok = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "--verify", "-q", f"{cand}^{{commit}}"],
                            capture_output=True)
        if ok.returncode == 0:
            return cand
    raise SystemExit(f"error: {git_dir} has no ref {ref!r}")


def _copy_out(name: str, paths: list[str], dest: Path) -> None:
    """Copy `paths` (relative to the source root) from source `name` into `dest`, keeping their layout."""
    var, default, ref_var, ref_default = SOURCES[name]
    src = Path(os.environ.get(var, default))
    if _is_git_dir(src):
        ref = _ref(src, os.environ.get(ref_var, ref_default))
        with tempfile.TemporaryFile() as tar:
            # (git may warn about unrelated objects missing from a partial mirror; only the status counts)
            done = subprocess.run(["git", f"--git-dir={src}", "archive", "--format=tar", ref, *paths], stdout=tar,
                                  stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise SystemExit(f"error: git archive {ref} in {src} failed: {done.stderr.strip()}")
            tar.seek(0)
            with tarfile.open(fileobj=tar) as tf:
                tf.extractall(dest, filter="data")
    else:
        for p in paths:
            s, d = src / p, dest / p
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(s, d, symlinks=True) if s.is_dir() else shutil.copy2(s, d)


def extract(src: dict[str, Path], work: Path) -> tuple[Path, Path, str]:
    """Lay out work/qa as Dockerfile.QA does for these suites: qa/L0_*, qa/common, qa/clients/*.py (the client
    examples), and return (qa dir, python_backend examples/decoupled dir, src/test repeat_int32 config text)."""
    up = work / "upstream"
    _copy_out("server", [f"qa/{d}" for d in SUITE_DIRS] + SERVER_PATHS, up / "server")
    _copy_out("client", ["src/python/examples"], up / "client")
    _copy_out("python_backend", ["examples/decoupled"], up / "python_backend")
    qa = work / "qa"
    shutil.copytree(up / "server" / "qa", qa)
    clients = qa / "clients"
    clients.mkdir()
    for f in (up / "client" / "src/python/examples").glob("*.py"):
        shutil.copy2(f, clients / f.name)
    repeat_cfg = (up / "server" / "src/test/models/repeat_int32/config.pbtxt").read_text()
    return qa, up / "python_backend" / "examples" / "decoupled", repeat_cfg
