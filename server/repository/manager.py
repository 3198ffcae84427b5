"""What is wanted vs what is live: scans the repositories, loads model versions, keeps each
version's state and reason, and resolves (model, version) for the data plane."""

from __future__ import annotations

import asyncio
import glob
import logging
from dataclasses import dataclass, field
from pathlib import Path

from server import backend_registry
from server.errors import PierError, invalid_arg, not_found, unavailable
from server.lifecycle.loaded_model import LoadedModel, build_loaded_model, create_instances
from server.lifecycle.state import ModelState
from server.protocol import model_config_pb2 as mc
from server.repository import model_config, source
from server.repository.version_policy import select_versions
from server.types import ModelSignature, ModelSpec

log = logging.getLogger("pier.repository")


@dataclass
class VersionRecord:
    state: ModelState
    reason: str = ""
    loaded: LoadedModel | None = None


@dataclass
class ModelRecord:
    name: str
    path: Path
    config: mc.ModelConfig | None = None
    error: str = ""  # model-level failure (bad config, no versions)
    versions: dict[int, VersionRecord] = field(default_factory=dict)


def gpu_count() -> int:
    """GPUs visible to this process (device nodes; no CUDA library needed to count)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def _describe(entry: backend_registry.BackendEntry, path: Path) -> ModelSignature | None:
    return backend_registry.get_backend(entry).describe(path)


class RepositoryManager:
    def __init__(self, repositories: list[Path], auto_complete: bool, load_concurrency: int = 4) -> None:
        self._repositories = repositories
        self._auto_complete = auto_complete
        self._models: dict[str, ModelRecord] = {}
        self._load_slots = asyncio.Semaphore(load_concurrency)
        self._gpus = gpu_count()

    # ---- loading -------------------------------------------------------------------------

    async def load_all(self, names: list[str] | None = None) -> list[str]:
        """Load every model (or `names`) concurrently; return one error line per failure."""
        sources = source.scan(self._repositories)
        for name, src in sources.items():
            self._models.setdefault(name, ModelRecord(name, src.path))
        wanted = list(sources) if names is None else names
        unknown = [n for n in wanted if n not in sources]
        errors = [f"failed to load '{n}': model not found in any model repository" for n in unknown]
        results = await asyncio.gather(*(self._load(sources[n]) for n in wanted if n in sources))
        errors.extend(e for e in results if e)
        return errors

    async def _load(self, src: source.ModelSource) -> str:
        record = self._models[src.name]
        async with self._load_slots:
            try:
                await self._load_versions(src, record)
            except PierError as exc:
                record.error = exc.message
                log.error("failed to load '%s': %s", src.name, exc.message)
                return f"failed to load '{src.name}': {exc.message}"
        failed = [f"version {v}: {r.reason}" for v, r in record.versions.items()
                  if r.state is not ModelState.READY]
        if failed:
            return f"failed to load '{src.name}': " + "; ".join(failed)
        return ""

    async def _load_versions(self, src: source.ModelSource, record: ModelRecord) -> None:
        if src.duplicate_of is not None:
            raise invalid_arg(f"model '{src.name}' exists in two repositories: {src.path} and {src.duplicate_of}")
        dirs = source.version_dirs(src.path)
        loop = asyncio.get_running_loop()
        config = await loop.run_in_executor(None, self._read_config, src, list(dirs.values()))
        record.config = config
        if not dirs:
            raise invalid_arg(f"model '{src.name}' has no version folders (numeric names) in {src.path}")
        versions = select_versions(config.version_policy, list(dirs))
        if not versions:
            raise invalid_arg(f"no version of model '{src.name}' on disk matches its version_policy")
        spec = model_config.build_spec(config)
        entry = backend_registry.lookup(spec.platform, spec.backend)
        for v in versions:
            record.versions[v] = VersionRecord(ModelState.LOADING)
        await asyncio.gather(*(self._load_version(record, entry, spec, v) for v in versions))

    def _read_config(self, src: source.ModelSource, dirs: list[Path]) -> mc.ModelConfig:
        path = src.config_path
        if path.exists():
            raw = model_config.parse_config_file(path)
        elif self._auto_complete:
            raw = mc.ModelConfig()
        else:
            raise invalid_arg(f"model '{src.name}' has no config.pbtxt and auto-complete is disabled")
        return model_config.complete_config(raw, src.name, dirs, str(path), self._auto_complete, _describe)

    async def _load_version(self, record: ModelRecord, entry: backend_registry.BackendEntry,
                            spec: ModelSpec, version: int) -> None:
        loop = asyncio.get_running_loop()
        vr = record.versions[version]
        try:
            backend = backend_registry.get_backend(entry)
            instances = await loop.run_in_executor(
                None, create_instances, backend, spec, version, record.path, self._gpus)
        except PierError as exc:
            vr.state, vr.reason = ModelState.UNAVAILABLE, exc.message
            return
        except Exception as exc:  # a backend failing to load must not take the server down
            vr.state, vr.reason = ModelState.UNAVAILABLE, f"{type(exc).__name__}: {exc}"
            return
        vr.loaded = build_loaded_model(spec, record.config, version, instances)
        vr.state, vr.reason = ModelState.READY, ""
        log.info("loaded '%s' version %d", record.name, version)

    async def unload_all(self) -> None:
        tasks = []
        for record in self._models.values():
            for vr in record.versions.values():
                if vr.loaded is not None:
                    vr.state, vr.reason = ModelState.UNLOADING, ""
                    tasks.append(vr.loaded.stop())
        await asyncio.gather(*tasks, return_exceptions=True)
        for record in self._models.values():
            for vr in record.versions.values():
                vr.loaded = None
                vr.state, vr.reason = ModelState.UNAVAILABLE, "unloaded"

    # ---- lookup --------------------------------------------------------------------------

    def resolve(self, name: str, version: str = "") -> LoadedModel:
        """Triton's lookup: the named version if READY, else the highest READY one."""
        record = self._models.get(name)
        if record is None or (not record.versions and not record.error):
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if version:
            if not version.isdigit():
                raise invalid_arg(f"invalid model version '{version}': versions are integers")
            vr = record.versions.get(int(version))
            if vr is None:
                raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
            if vr.state is not ModelState.READY or vr.loaded is None:
                raise unavailable(f"Request for unknown model: '{name}' version {version} is not at ready state")
            return vr.loaded
        for v in sorted(record.versions, reverse=True):
            vr = record.versions[v]
            if vr.state is ModelState.READY and vr.loaded is not None:
                return vr.loaded
        raise not_found(f"Request for unknown model: '{name}' has no available versions")

    def ready_versions(self, name: str) -> list[int]:
        record = self._models.get(name)
        if record is None:
            return []
        return sorted(v for v, r in record.versions.items() if r.state is ModelState.READY)

    def loaded_models(self) -> list[LoadedModel]:
        return [vr.loaded for r in self._models.values() for vr in r.versions.values() if vr.loaded]

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Repository index rows: one per model version known, name only for never-loaded ones."""
        rows: list[dict[str, str]] = []
        for name in sorted(set(self._models) | set(source.scan(self._repositories))):
            record = self._models.get(name)
            if record is None or (not record.versions and not record.error):
                if not ready_only:
                    rows.append({"name": name})
                continue
            if not record.versions:
                if not ready_only:
                    rows.append({"name": name, "state": "UNAVAILABLE", "reason": record.error})
                continue
            for v, vr in sorted(record.versions.items()):
                if ready_only and vr.state is not ModelState.READY:
                    continue
                row = {"name": name, "version": str(v), "state": vr.state.value}
                if vr.reason:
                    row["reason"] = vr.reason
                rows.append(row)
        return rows

    def all_ready(self) -> bool:
        """Every model has at least one version and each is READY (strict readiness)."""
        for record in self._models.values():
            if not record.versions and not record.error:
                continue  # never asked to load (explicit mode): not part of readiness
            if record.error:
                return False
            if any(vr.state is not ModelState.READY for vr in record.versions.values()):
                return False
        return True

    def status_table(self) -> list[tuple[str, str, str]]:
        rows = []
        for name in sorted(self._models):
            record = self._models[name]
            if not record.versions and record.error:
                rows.append((name, "-", f"UNAVAILABLE: {record.error}"))
            for v, vr in sorted(record.versions.items()):
                rows.append((name, str(v), vr.state.value + (f": {vr.reason}" if vr.reason else "")))
        return rows
