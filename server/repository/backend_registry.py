"""Backend/platform strings -> backend classes, imported lazily so that a missing optional
framework (torch, tensorrt) only fails the models that need it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from pier.contract.backend import Backend
from pier.contract.errors import PierError, invalid_arg, unavailable


@dataclass(frozen=True)
class BackendEntry:
    backend: str  # canonical backend name, as config `backend`
    platform: str  # canonical platform string ("" when the backend has none)
    module: str  # module with a `BACKEND` class attribute
    default_model_filename: str
    takes_settings: bool = False  # its BACKEND has configure(settings) for --backend-config
    other_model_files: tuple[str, ...] = ()  # glob patterns of other files the backend serves a version from

    def model_file(self, version_dir: Path, default: str | None = None) -> Path | None:
        """The version folder's model file: `default` (the config's default_model_filename, else the
        entry's) where present, else the first match of `other_model_files`."""
        path = version_dir / (default or self.default_model_filename)
        if path.exists():
            return path
        return next((m for pattern in self.other_model_files for m in sorted(version_dir.glob(pattern))), None)


_ENTRIES: tuple[BackendEntry, ...] = (
    BackendEntry("onnxruntime", "onnxruntime_onnx", "pier.backends.onnxruntime.backend", "model.onnx"),
    BackendEntry("pytorch", "pytorch_libtorch", "pier.backends.pytorch.backend", "model.pt"),
    BackendEntry("tensorrt", "tensorrt_plan", "pier.backends.tensorrt.backend", "model.plan"),
    BackendEntry("python", "", "pier.backends.python.backend", "model.py", takes_settings=True),
    # a Hugging Face folder, or a GGUF file (backends/llm/models/gguf.py)
    BackendEntry("llm", "", "pier.backends.llm.backend", "config.json", takes_settings=True,
                 other_model_files=("*.gguf",)),
)
# Ensembles have a platform and no backend: the server schedules their steps itself.
ENSEMBLE = BackendEntry("", "ensemble", "", "")

_BY_NAME: dict[str, BackendEntry] = {}
for _e in (*_ENTRIES, ENSEMBLE):
    for _n in (_e.backend, _e.platform):
        if _n:
            _BY_NAME[_n] = _e

_LOADED: dict[str, Backend] = {}


def lookup(platform: str, backend: str) -> BackendEntry:
    """The entry for a config's platform/backend pair; INVALID_ARG when unknown or inconsistent."""
    by_platform = _BY_NAME.get(platform) if platform else None
    by_backend = _BY_NAME.get(backend) if backend else None
    if platform and by_platform is None:
        raise invalid_arg(f"unknown platform '{platform}'")
    if backend and by_backend is None:
        raise invalid_arg(f"unable to find backend '{backend}'")
    if by_platform and by_backend and by_platform is not by_backend:
        raise invalid_arg(f"platform '{platform}' does not match backend '{backend}'")
    entry = by_platform or by_backend
    if entry is None:
        raise invalid_arg("the model configuration must name a 'platform' or a 'backend'")
    return entry


def detect(version_dirs: list[Path]) -> BackendEntry | None:
    """Guess the backend from the default model file present in a version folder."""
    for entry in _ENTRIES:
        for d in version_dirs:
            if entry.model_file(d) is not None:
                return entry
    return None


def get_backend(entry: BackendEntry) -> Backend:
    """Import (once) and return the backend object for `entry`."""
    backend = _LOADED.get(entry.backend)
    if backend is None:
        try:
            module = importlib.import_module(entry.module)
        except ImportError as exc:
            raise unavailable(
                f"backend '{entry.backend}' is not available: {exc}. Install the extra it needs."
            ) from exc
        backend = module.BACKEND
        if not isinstance(backend, Backend):  # pragma: no cover - programming error
            raise TypeError(f"{entry.module}.BACKEND is not a Backend")
        _LOADED[entry.backend] = backend
    return backend


def configure(backend: str, settings: dict[str, str]) -> tuple[str, ...] | None:
    """`--backend-config=<backend>,KEY=VALUE` settings, handed to the backend now (its
    `configure(settings)` hook). None when the backend takes no settings (they have no effect);
    else the keys it accepted without effect. Raises ValueError (naming the key) for a setting it
    refuses."""
    entry = _BY_NAME.get(backend)
    if entry is None or not entry.backend or not entry.takes_settings:
        return None
    try:
        loaded = get_backend(entry)
    except PierError:
        return None
    hook = getattr(loaded, "configure", None)
    if hook is None:
        return None
    return tuple(hook(dict(settings)))
