"""`pier serve PATH`: one model from a path, as `vllm serve DIR` and `mlserver start .` take one.

PATH is told apart by what it holds, never by guessing from its name alone:

- a Hugging Face model folder (config.json beside *.safetensors), a `.gguf` file or a folder holding
  one: the LLM backend serves it;
- an `.onnx` file: ONNX Runtime serves it, its tensors read from the file (auto-complete);
- a Triton model folder (config.pbtxt and/or numeric version folders): served as it is;
- a model repository (folders of models): served as `--model-repository PATH` would.

A model that is not a repository is served from a private repository of one made for the run (a
folder of links: nothing is copied, nothing is written beside the model), under the model's name:
the folder's or file's name, or `--served-model-name`. Its config is completed as auto-complete
completes any config.pbtxt (the server logs the result)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pier.repository import source

HF = "hf"
GGUF = "gguf"
ONNX = "onnx"
MODEL = "model"
REPOSITORY = "repository"

# What config.pbtxt names for each kind served from a repository of one; the rest is auto-completed.
_CONFIGS = {HF: 'backend: "llm"\n', GGUF: 'backend: "llm"\n', ONNX: 'platform: "onnxruntime_onnx"\n'}


@dataclass(frozen=True)
class ServedPath:
    """What `pier serve PATH` found at PATH: its kind, the path (absolute) and the model's name
    ("" for a repository: its models keep their own names)."""

    kind: str
    path: Path
    name: str = ""


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.pbtxt").is_file() or bool(source.version_dirs(folder))


def _check_name(name: str, path: Path) -> str:
    if not name or "/" in name or name in (".", "..") or name.startswith("."):
        raise ValueError(f"'{name}' (from {path}) cannot name a model: give one with --served-model-name")
    return name


def classify(path: Path, served_name: str = "") -> ServedPath:
    """What PATH is; ValueError says what was expected when it is none of the kinds served."""
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    path = path.resolve()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".onnx":
            return ServedPath(ONNX, path, _check_name(served_name or path.stem, path))
        if suffix == ".gguf":
            return ServedPath(GGUF, path, _check_name(served_name or path.stem, path))
        raise ValueError(f"{path}: a file to serve must be an .onnx model or a .gguf file (a folder may be a Hugging "
                         "Face model, a model or a model repository)")
    if not _is_model_folder(path) and not (path / "config.json").is_file() and any(path.glob("*.gguf")):
        return ServedPath(HF, path, _check_name(served_name or path.name, path))
    if (path / "config.json").is_file() and not _is_model_folder(path):
        if not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
            raise ValueError(f"{path}: a Hugging Face folder needs its weights as *.safetensors (none here; "
                             "pytorch_model.bin is not read: save the model with safe_serialization=True)")
        return ServedPath(HF, path, _check_name(served_name or path.name, path))
    if _is_model_folder(path):
        return ServedPath(MODEL, path, _check_name(served_name or path.name, path))
    if any(_is_model_folder(d) for d in path.iterdir() if d.is_dir() and not d.name.startswith(".")):
        if served_name:
            raise ValueError(f"{path} is a model repository: its models keep their names (no --served-model-name)")
        return ServedPath(REPOSITORY, path)
    raise ValueError(f"{path}: not a Hugging Face model folder (config.json + *.safetensors), an .onnx file, "
                     "a model folder (config.pbtxt, version folders) or a model repository")


def make_repository(served: ServedPath, root: Path) -> Path:
    """The repository that serves `served`, built under `root` (PATH itself for a repository)."""
    if served.kind == REPOSITORY:
        return served.path
    repo = root / "repository"
    model = repo / served.name
    if served.kind == MODEL:
        repo.mkdir(parents=True)
        model.symlink_to(served.path, target_is_directory=True)
        return repo
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(_CONFIGS[served.kind])
    if served.kind == HF:
        (model / "1").symlink_to(served.path, target_is_directory=True)
    else:
        (model / "1").mkdir()
        (model / "1" / ("model.onnx" if served.kind == ONNX else served.path.name)).symlink_to(served.path)
    return repo


@contextlib.contextmanager
def repository(served: ServedPath) -> Iterator[Path]:
    """make_repository in a private temporary folder, removed (the links only) when done."""
    root = Path(tempfile.mkdtemp(prefix="pier-serve-"))
    try:
        yield make_repository(served, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
