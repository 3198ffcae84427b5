"""docs/architecture.md names only files and folders that exist; README and docs link only to
files that exist and never outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"`((?:server|backends|tests|bench|scripts|protos|docs|docker)/[^`\s]*)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


# Any code span that names a file (a known extension) or a folder (a trailing slash).
ANY_PATH = re.compile(r"`([\w./<>-]*\.(?:py|pyi|md|sh|toml|json|cpp|h|proto|pbtxt|yaml)|[\w./<>-]+/)`")


def test_architecture_names_only_paths_that_exist() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = PATH.findall(text)
    assert len(paths) > 40  # the page is a map, not a sketch
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_path_the_architecture_page_names_exists() -> None:
    """Also the short names (`stub.py`, `openai/`): each is the end of some path in the
    repository (placeholders such as `<name>/` aside)."""
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
             if ".git" not in p.parts and ".venv" not in p.parts and "build" not in p.parts]
    known = set(files) | {f + "/" for f in files}
    outside = {"tritonbackend.h", "build/"}  # Triton's header, named for comparison; make's output
    names = [n for n in ANY_PATH.findall((ROOT / "docs" / "architecture.md").read_text())
             if "<" not in n and n not in outside]
    assert len(names) > 80
    missing = [n for n in names if n.lstrip("./") not in known and not any(k.endswith("/" + n) for k in known)]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_docs_link_only_to_files_in_the_repository() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
            assert resolved.exists(), f"{page.name} links to a missing file: {target}"


def test_nothing_a_user_reads_or_runs_points_outside_the_repository() -> None:
    """The reference material beside the checkout is not what users have: the README, the docs, the
    Makefile, CI, the scripts, the tests, the images, the chart and the example models never name
    it. Only bench/ may use its tools (PIER_REFERENCE_TOOLS), skipping with a note where absent."""
    beside = ("/".join(("..", "shared")), "/".join(("", "work", "shared")))  # spelt so: this file names neither
    files = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / ".ci").iterdir())]
    for folder in ("docs", "scripts", "tests", "docker", "deploy", "model_repository", "server", "backends"):
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    offenders = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a model file, an image
            continue
        offenders += [f"{path.relative_to(ROOT)}: {b}" for b in beside if b in text]
    assert len(files) > 200 and not offenders, offenders
