"""What is on disk: a model folder read into what a load needs (completed config, spec, version
folders, fingerprints), and the temporary folders that hold the files a load request sends.
Every function here blocks (file reads, hashing, copies, rmtree): the manager runs them in an
executor, never on the event loop."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pier.contract.errors import PierError, invalid_arg
from pier.contract.types import ModelSignature, ModelSpec
from pier.protocol import model_config_pb2 as mc
from pier.repository import backend_registry, model_config, source
from pier.repository.spec import build_spec
from pier.repository.version_policy import select_versions

WEIGHTS_PARAMETER = "traffic_weights"  # config parameter: "1:90,2:10"


def check_file_parameter(rel: str) -> None:
    """A load request's `file:<rel>`: a relative path inside the model folder (checked before the
    load starts, so that a refused request changes nothing)."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts or "\0" in rel:
        raise invalid_arg(f"invalid file parameter 'file:{rel}': expected a path inside the model folder, "
                          "e.g. 'file:1/model.onnx' or 'file:labels.txt'")


@dataclass
class LoadOverride:
    """What a load request brings: a config that replaces config.pbtxt and/or model files."""

    config_json: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)  # "<version>/<path>" -> content


def parse_weights(text: str) -> dict[int, float]:
    """"1:90,2:10" -> {1: 90.0, 2: 10.0}."""
    out: dict[int, float] = {}
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        v, sep, w = part.partition(":")
        try:
            if not sep:
                raise ValueError
            out[int(v)] = float(w)
        except ValueError:
            raise invalid_arg(f"invalid traffic weight '{part}': expected <version>:<weight>") from None
    return out


def dependencies(config: mc.ModelConfig) -> list[str]:
    """Models an ensemble composes (in step order, without repeats)."""
    names: list[str] = []
    for step in config.ensemble_scheduling.step:
        if step.model_name not in names:
            names.append(step.model_name)
    return names


def tree_fingerprint(path: Path) -> str:
    """Names, sizes and modification times of every file under `path` (cheap; no reads)."""
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(path.rglob("*")):
            try:
                st = f.stat()
            except OSError:
                continue
            h.update(f"{f.relative_to(path)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _file_fingerprint(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "-"


def folder_fingerprint(path: Path | None, config_name: str, pinned: set[int], excluded: set[int]) -> str:
    """What poll mode compares: the config file's bytes, the folder's files, and which versions
    the per-version API pinned or excluded ("" when there is no folder)."""
    if path is None:
        return ""
    h = hashlib.sha256()
    h.update(_file_fingerprint(source.config_file(path, config_name)).encode())
    h.update(tree_fingerprint(path).encode())
    h.update(f"{sorted(pinned)}{sorted(excluded)}".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ModelOnDisk:
    """A model folder read for a load: what the life cycle needs to bring its versions up."""

    path: Path
    config: mc.ModelConfig  # completed
    spec: ModelSpec
    entry: backend_registry.BackendEntry
    wanted: frozenset[int]  # versions to serve
    fingerprints: dict[int, str]  # per wanted version: the completed config + its folder
    weights: dict[int, float] | None  # the config's traffic_weights parameter, when it has one
    dependencies: list[str]  # an ensemble's composing models, or an adapter model's base (base_model)


def read_model(name: str, path: Path, override: LoadOverride | None, config_name: str, auto_complete: bool,
               pinned: set[int], excluded: set[int]) -> ModelOnDisk:
    """Read `name`'s folder (and a load request's config) into a ModelOnDisk; PierError names
    what is wrong."""
    dirs = source.version_dirs(path)
    config = _read_config(name, path, override, config_name, auto_complete, list(dirs.values()))
    if not dirs:
        raise invalid_arg(f"model '{name}' has no version folders (numeric names) in {path}")
    wanted = set(select_versions(config.version_policy, list(dirs))) | (pinned & set(dirs))
    if not wanted:  # Triton's refusal (a `specific` policy naming no existing folder, say)
        raise invalid_arg(f"at least one version must be available under the version policy of model '{name}'")
    wanted -= excluded
    spec = build_spec(config, path)
    entry = backend_registry.lookup(spec.platform, spec.backend)
    weights = parse_weights(config.parameters[WEIGHTS_PARAMETER].string_value) \
        if WEIGHTS_PARAMETER in config.parameters else None
    config_fp = hashlib.sha256(config.SerializeToString(deterministic=True)).hexdigest()
    fingerprints = {v: config_fp + tree_fingerprint(dirs[v]) for v in sorted(wanted)}
    deps = dependencies(config) + [b for b in (model_config.base_model(config),) if b]
    return ModelOnDisk(path, config, spec, entry, frozenset(wanted), fingerprints, weights, deps)


def _describe(entry: backend_registry.BackendEntry, path: Path) -> ModelSignature | None:
    return backend_registry.get_backend(entry).describe(path)


def _read_config(name: str, path: Path, override: LoadOverride | None, config_name: str, auto_complete: bool,
                 dirs: list[Path]) -> mc.ModelConfig:
    config_path = source.config_file(path, config_name)
    if override is not None and override.config_json:
        origin = f"the 'config' parameter of '{name}'"
        try:
            raw = model_config.parse_config_json(override.config_json, origin)
        except PierError as exc:  # Triton's words for it (L0_http's test.sh greps the server log for them)
            raise invalid_arg(f"Invalid config override: {exc.message}") from None
    elif config_path.exists():
        raw, origin = model_config.parse_config_file(config_path), str(config_path)
    elif auto_complete:
        raw, origin = mc.ModelConfig(), str(config_path)
    else:
        raise invalid_arg(f"model '{name}' has no config.pbtxt and auto-complete is disabled")
    return model_config.complete_config(raw, name, dirs, origin, auto_complete, _describe)


def write_override(name: str, files: dict[str, bytes]) -> Path:
    """A temporary model folder holding the files a load request sent (`<tmp>/<name>/<rel>`)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"pier-{name}-"))
    root = (tmp / name).resolve()
    for rel, content in files.items():
        target = (root / rel).resolve()
        if not target.is_relative_to(root):  # check_file_parameter refused it already
            shutil.rmtree(tmp, ignore_errors=True)
            raise invalid_arg(f"invalid file parameter 'file:{rel}'")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    return root


def remove_override(root: Path) -> None:
    """Delete a folder write_override made."""
    shutil.rmtree(root.parent, ignore_errors=True)
