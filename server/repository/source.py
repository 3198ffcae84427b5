"""What exists on disk: model folders across repositories and their numeric version folders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSource:
    name: str  # the model's key: its name, or with namespacing its folder's path (see `model_name`)
    path: Path  # <repository>/<model>
    duplicate_of: Path | None = None  # set when the same name exists in two repositories

    @property
    def model_name(self) -> str:
        return self.path.name


def model_name(key: str) -> str:
    """The model name in a key: keys are names, or with --model-namespacing "<repository>/<name>"
    (a model name has no '/')."""
    return key.rpartition("/")[2]


def namespace(key: str) -> str:
    """The namespace (repository path) in a key; "" without namespacing."""
    return key.rpartition("/")[0]


def config_file(model_path: Path, config_name: str = "") -> Path:
    """The model's configuration file: `configs/<config_name>.pbtxt` when --model-config-name names
    one the model has, else `config.pbtxt` (Triton's custom model configuration rule)."""
    if config_name:
        custom = model_path / "configs" / f"{config_name}.pbtxt"
        if custom.is_file():
            return custom
    return model_path / "config.pbtxt"


def scan(repositories: list[Path], namespacing: bool = False) -> dict[str, ModelSource]:
    """Every model folder in every repository, by key. A name found twice is kept but marked, so
    the manager can report it unavailable (as Triton does) instead of picking one silently; with
    namespacing each repository is a namespace, and keys are the folders' paths."""
    found: dict[str, ModelSource] = {}
    for repo in repositories:
        for entry in sorted(repo.iterdir()):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            if namespacing:
                found[str(entry)] = ModelSource(str(entry), entry)
            elif entry.name in found:
                found[entry.name] = ModelSource(entry.name, found[entry.name].path, duplicate_of=entry)
            else:
                found[entry.name] = ModelSource(entry.name, entry)
    return found


def version_dirs(model_path: Path) -> dict[int, Path]:
    """Numeric version folders. Names that are not integers (ASCII digits only), that start with
    '0', or that are past int64 (a version number is one) are ignored."""
    out: dict[int, Path] = {}
    for entry in model_path.iterdir():
        if entry.is_dir() and is_version(entry.name) and not entry.name.startswith("0") and int(entry.name) < 2**63:
            out[int(entry.name)] = entry
    return out


def is_version(text: str) -> bool:
    """A version as requests and folders name one: ASCII digits ("١" is a digit to str.isdigit)."""
    return text.isascii() and text.isdigit()
