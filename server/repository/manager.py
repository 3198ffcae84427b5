"""What is wanted vs what is live. The manager reconciles each model with its folder (or with a
load request's overrides): it loads what is new or changed while the current versions keep
serving, switches atomically, and retires what is no longer wanted after its in-flight requests
finish. Operations on one model are serialized by a per-model lock; different models load in
parallel. It also routes unversioned requests: to the newest READY version, or by traffic
weights during a rollout."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import glob
import hashlib
import logging
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pier import backend_registry
from pier.contract.backend import ServerServices
from pier.contract.errors import PierError, invalid_arg, not_found, unavailable
from pier.contract.types import ModelSignature, ModelSpec
from pier.lifecycle.loaded_model import LoadedModel, build_loaded_model, create_instances
from pier.lifecycle.state import ModelState
from pier.lifecycle.warmup import record_warmup, warm_up
from pier.protocol import model_config_pb2 as mc
from pier.repository import model_config, source
from pier.repository.version_policy import select_versions
from pier.scheduling.ensemble import EnsemblePlan, EnsembleScheduler, build_plan
from pier.statistics import ModelStatistics

log = logging.getLogger("pier.repository")

UNLOADED = "unloaded"
WEIGHTS_PARAMETER = "traffic_weights"  # config parameter: "1:90,2:10"


def check_file_parameter(rel: str) -> None:
    """A load request's `file:<rel>`: a relative path inside the model folder (checked before the
    load starts, so that a refused request changes nothing)."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts or "\0" in rel:
        raise invalid_arg(f"invalid file parameter 'file:{rel}': expected a path inside the model folder, "
                          "e.g. 'file:1/model.onnx' or 'file:labels.txt'")


@dataclass
class VersionRecord:
    state: ModelState
    reason: str = ""
    loaded: LoadedModel | None = None
    fingerprint: str = ""  # of the completed config + the version folder, when loaded
    draining: LoadedModel | None = None


@dataclass
class LoadOverride:
    """What a load request brings: a config that replaces config.pbtxt and/or model files."""

    config_json: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)  # "<version>/<path>" -> content


@dataclass
class ModelRecord:
    name: str
    error: str = ""  # model-level failure (bad config, no versions)
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    disk_fingerprint: str = ""  # what the last reconcile saw (poll skips unchanged models)
    pinned: set[int] = field(default_factory=set)  # versions loaded by the per-version API
    excluded: set[int] = field(default_factory=set)  # versions unloaded by the per-version API
    weights: dict[int, float] = field(default_factory=dict)  # rollout; empty = newest READY
    override_dir: Path | None = None  # temporary folder holding files sent in a load request
    override: LoadOverride | None = None
    dependents: set[str] = field(default_factory=set)  # composing models this one loaded
    removed: bool = False  # its folder is gone (poll): hidden from the index once drained
    # routing snapshot, rebuilt on every change (the hot path reads only these)
    newest: LoadedModel | None = None
    route_models: list[LoadedModel] = field(default_factory=list)
    route_cumulative: list[float] = field(default_factory=list)

    def ready(self) -> dict[int, LoadedModel]:
        return {v: vr.loaded for v, vr in self.versions.items()
                if vr.state is ModelState.READY and vr.loaded is not None}


def gpu_count() -> int:
    """GPUs visible to this process (device nodes; no CUDA library needed to count)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def _describe(entry: backend_registry.BackendEntry, path: Path) -> ModelSignature | None:
    return backend_registry.get_backend(entry).describe(path)


def _tree_fingerprint(path: Path) -> str:
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


class RepositoryManager:
    def __init__(self, repositories: list[Path], auto_complete: bool, load_concurrency: int = 4,
                 keep_recent: bool = False, config_name: str = "") -> None:
        self._repositories = repositories
        self._config_name = config_name  # --model-config-name: configs/<name>.pbtxt when a model has one
        self._keep_recent = keep_recent  # statistics keep recent requests (the summary metrics need them)
        self._auto_complete = auto_complete
        self._models: dict[str, ModelRecord] = {}
        self._load_slots = asyncio.Semaphore(max(load_concurrency, 1))
        self._gpus = gpu_count()
        self._retiring: set[asyncio.Task] = set()
        self.services: ServerServices | None = None  # set once the data plane exists (BLS, ensembles)

    def _record(self, name: str) -> ModelRecord:
        record = self._models.get(name)
        if record is None:
            record = self._models[name] = ModelRecord(name)
        return record

    # ---- operations ----------------------------------------------------------------------

    async def load_all(self, names: list[str] | None = None) -> list[str]:
        """Load every model in the repositories (or `names`) concurrently; one error line per failure."""
        sources = source.scan(self._repositories)
        wanted = list(sources) if names is None else names
        results = await asyncio.gather(*(self._load_or_error(n, sources) for n in wanted))
        return [e for e in results if e]

    async def _load_or_error(self, name: str, sources: dict[str, source.ModelSource]) -> str:
        try:
            await self.load(name, sources=sources)
        except PierError as exc:
            return exc.message
        return ""

    async def load(self, name: str, override: LoadOverride | None = None,
                   sources: dict[str, source.ModelSource] | None = None, _chain: tuple[str, ...] = ()) -> None:
        """Load or reload `name` (only what changed, unless an override forces a reload). Raises
        PierError naming the model when it fails; what served before keeps serving."""
        if sources is None:
            sources = source.scan(self._repositories)
        src = sources.get(name)
        if src is None and (override is None or not override.files):
            raise invalid_arg(f"failed to load '{name}': model not found in any model repository")
        record = self._record(name)
        async with record.lock:
            error = await self._reconcile(record, src, override, force=override is not None, sources=sources,
                                          chain=(*_chain, name))
        if error:
            raise invalid_arg(f"failed to load '{name}': {error}")

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        """Stop routing to every version of `name`; each finishes its in-flight requests in the
        background. Unloading a model that is not loaded succeeds (as Triton)."""
        record = self._models.get(name)
        if record is None:
            return
        async with record.lock:
            composing = {d for m in record.ready().values() for d in dependencies(m.config)}
            for v in list(record.versions):
                self._retire(record, v)
            record.pinned.clear()
            record.excluded.clear()
            record.disk_fingerprint = record.error = ""  # a failed load, unloaded, no longer counts
            self._drop_override(record)
            dependents, record.dependents = record.dependents, set()
            self._refresh_routes(record)
        log.info("unloading '%s'", name)
        # As Triton: an ensemble that composes this model cannot serve without it, so it goes too.
        for other in sorted(self._ensembles_using(name)):
            await self.unload(other)
        if unload_dependents:
            # As Triton: the models this ensemble composes (or whose load it started) go too,
            # unless another loaded ensemble still uses them.
            for dep in sorted(dependents | composing):
                if not self._ensembles_using(dep):
                    await self.unload(dep, unload_dependents=True)

    def _ensembles_using(self, name: str) -> set[str]:
        """Models with a READY version that is an ensemble composing `name`."""
        return {r.name for r in self._models.values() if r.name != name
                and any(name in dependencies(m.config) for m in r.ready().values())}

    async def load_version(self, name: str, version: int) -> None:
        """Serve `version` beside what serves now: the versions serving stay (pinned, as if loaded
        by this API) even when a newer folder on disk would make the version policy pick
        another, so a canary never unloads what it is compared with."""
        record = self._record(name)
        async with record.lock:
            src = None if record.override_dir else source.scan(self._repositories).get(name)
            path = record.override_dir or (src.path if src else None)
            if path is None or version not in source.version_dirs(path):
                raise not_found(f"failed to load '{name}' version {version}: no such version folder")
            override = LoadOverride(record.override.config_json) if record.override else None
            record.pinned |= {v for v, vr in record.versions.items() if vr.loaded is not None}
            record.pinned.add(version)
            record.excluded.discard(version)
            error = await self._reconcile(record, src, override, force=False, sources=None, chain=(name,))
        if error:
            raise invalid_arg(f"failed to load '{name}' version {version}: {error}")

    async def unload_version(self, name: str, version: int) -> None:
        record = self._models.get(name)
        if record is None or version not in record.versions:
            raise not_found(f"failed to unload '{name}' version {version}: the version is not loaded")
        async with record.lock:
            record.excluded.add(version)
            record.pinned.discard(version)
            self._retire(record, version)
            self._refresh_routes(record)
        log.info("unloading '%s' version %d", name, version)

    async def poll(self) -> list[str]:
        """Apply what changed on disk: new and edited models load, deleted ones unload."""
        sources = source.scan(self._repositories)
        names = sorted(set(sources) | {n for n, r in self._models.items() if r.override_dir is None})
        results = await asyncio.gather(*(self._poll_one(n, sources) for n in names))
        return [e for e in results if e]

    async def _poll_one(self, name: str, sources: dict[str, source.ModelSource]) -> str:
        src = sources.get(name)
        if src is None:
            record = self._models.get(name)
            if record is not None and (record.versions or record.error):
                log.info("model '%s' was removed from the repository", name)
                await self.unload(name)
                record.error, record.removed = "", True
            return ""
        record = self._record(name)
        async with record.lock:
            if self._disk_fingerprint(record, src) == record.disk_fingerprint:
                return ""
            error = await self._reconcile(record, src, None, force=False, sources=sources, chain=(name,))
        return f"failed to load '{name}': {error}" if error else ""

    async def unload_all(self) -> None:
        for record in self._models.values():
            for v in list(record.versions):
                self._retire(record, v)
            self._refresh_routes(record)
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)
        for record in self._models.values():
            self._drop_override(record)

    # ---- rollout -------------------------------------------------------------------------

    def set_weights(self, name: str, weights: dict[int, float]) -> dict[int, float]:
        """Split unversioned traffic over READY versions; {} goes back to newest READY."""
        record = self._models.get(name)
        if record is None or not record.ready():
            raise not_found(f"model '{name}' has no READY version to route traffic to")
        ready = record.ready()
        for v, w in weights.items():
            if not math.isfinite(w) or w < 0:
                raise invalid_arg(f"traffic weight for version {v} of '{name}' must be a finite number >= 0, got {w}")
            if v not in ready:
                raise invalid_arg(f"version {v} of model '{name}' is not READY: it cannot take traffic")
        if weights and sum(weights.values()) <= 0:
            raise invalid_arg(f"traffic weights for '{name}' must not all be zero")
        record.weights = {v: w for v, w in weights.items() if w > 0}
        self._refresh_routes(record)
        log.info("traffic for '%s': %s", name, self.describe_traffic(name) or "newest READY version")
        return self.traffic(name)

    def rollback(self, name: str, version: int | None = None) -> dict[int, float]:
        """All traffic to `version`, or to the newest READY version older than the newest one
        taking traffic now."""
        record = self._models.get(name)
        ready = record.ready() if record is not None else {}
        if not ready:
            raise not_found(f"model '{name}' has no READY version to route traffic to")
        if version is None:
            current = max(self.traffic(name) or [0])
            older = [v for v in ready if v < current]
            if not older:
                raise invalid_arg(f"model '{name}' has no READY version older than {current} to roll back to")
            version = max(older)
        return self.set_weights(name, {version: 100.0})

    def traffic(self, name: str) -> dict[int, float]:
        """Percent of unversioned traffic per version, as routed now."""
        record = self._models.get(name)
        if record is None:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if not record.route_models:
            if record.newest is not None:
                return {record.newest.version: 100.0}
            return {}
        total = record.route_cumulative[-1]
        prev = 0.0
        out: dict[int, float] = {}
        for m, c in zip(record.route_models, record.route_cumulative):
            out[m.version] = round(100.0 * (c - prev) / total, 2)
            prev = c
        return out

    def describe_traffic(self, name: str) -> str:
        record = self._models.get(name)
        if record is None or not record.route_models:
            return ""
        return ", ".join(f"v{v} {p:g}%" for v, p in self.traffic(name).items())

    # ---- lookup --------------------------------------------------------------------------

    def resolve(self, name: str, version: str = "") -> LoadedModel:
        """Triton's lookup: the named version if READY; else the newest READY one (or one picked
        by the rollout weights)."""
        if version and not source.is_version(version):  # as Triton, before the model lookup
            raise invalid_arg(f"failed to get model version from specified version string '{version}' "
                              "(details: stol), version should be an integral value > 0")
        record = self._models.get(name)
        if record is None or (not record.versions and not record.error):
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if version:
            vr = record.versions.get(int(version))
            if vr is None:
                raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
            if vr.state is not ModelState.READY or vr.loaded is None:
                raise unavailable(f"Request for unknown model: '{name}' version {version} is not at ready state")
            return vr.loaded
        if record.route_models:
            cumulative = record.route_cumulative
            i = bisect.bisect_right(cumulative, random.random() * cumulative[-1])
            return record.route_models[min(i, len(cumulative) - 1)]
        if record.newest is not None:
            return record.newest
        raise not_found(f"Request for unknown model: '{name}' has no available versions")

    def ready_versions(self, name: str) -> list[int]:
        record = self._models.get(name)
        return sorted(record.ready()) if record is not None else []

    def loaded_models(self) -> list[LoadedModel]:
        return [vr.loaded for r in self._models.values() for vr in r.versions.values() if vr.loaded]

    def metered_models(self) -> list[LoadedModel]:
        """What the metrics report: the loaded versions, and those still draining their in-flight
        requests while they unload (as Triton keeps their series until the unload ends)."""
        return [m for r in self._models.values() for vr in r.versions.values() if (m := vr.loaded or vr.draining)]

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Repository index rows: one per model version known, name only for never-loaded ones."""
        rows: list[dict[str, str]] = []
        for name in sorted(set(self._models) | set(source.scan(self._repositories))):
            record = self._models.get(name)
            if record is not None and record.removed and not any(
                    vr.state is not ModelState.UNAVAILABLE for vr in record.versions.values()):
                continue
            if record is None or (not record.versions and not record.error):
                if not ready_only:
                    rows.append({"name": name})
                continue
            if not record.versions:
                if not ready_only:
                    rows.append({"name": name, "state": "UNAVAILABLE", "reason": record.error})
                continue
            split = self.traffic(name) if record.route_models else {}
            for v, vr in sorted(record.versions.items()):
                if ready_only and vr.state is not ModelState.READY:
                    continue
                row = {"name": name, "version": str(v), "state": vr.state.value}
                reason = vr.reason
                if vr.state is ModelState.READY and split:
                    reason = f"traffic {split.get(v, 0.0):g}%"
                if reason:
                    row["reason"] = reason
                rows.append(row)
        return rows

    def all_ready(self) -> bool:
        """Strict readiness: every model asked for has a version and none failed (versions
        unloaded on purpose, loading or draining do not count against it)."""
        for record in self._models.values():
            if not record.versions and not record.error:
                continue  # never asked to load (explicit mode): not part of readiness
            if record.error and not record.ready():
                return False
            for vr in record.versions.values():
                if vr.state is ModelState.UNAVAILABLE and vr.reason != UNLOADED:
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

    # ---- reconcile -----------------------------------------------------------------------

    def _disk_fingerprint(self, record: ModelRecord, src: source.ModelSource | None) -> str:
        path = record.override_dir or (src.path if src else None)
        if path is None:
            return ""
        h = hashlib.sha256()
        h.update(_file_fingerprint(source.config_file(path, self._config_name)).encode())
        h.update(_tree_fingerprint(path).encode())
        h.update(f"{sorted(record.pinned)}{sorted(record.excluded)}".encode())
        return h.hexdigest()

    async def _reconcile(self, record: ModelRecord, src: source.ModelSource | None,
                         override: LoadOverride | None, force: bool,
                         sources: dict[str, source.ModelSource] | None, chain: tuple[str, ...]) -> str:
        """Bring `record` to what its folder (and `override`) asks for. Holds record.lock.
        Returns "" or the reason it failed (what served before keeps serving)."""
        loop = asyncio.get_running_loop()
        if src is not None and src.duplicate_of is not None:
            return self._fail(record, f"model '{record.name}' exists in two repositories: {src.path} "
                                      f"and {src.duplicate_of}")
        try:
            path = await loop.run_in_executor(None, self._materialize, record, src, override)
            disk_fp = self._disk_fingerprint(record, src)
            dirs = source.version_dirs(path)
            config = await loop.run_in_executor(None, self._read_config, record.name, path, override,
                                                list(dirs.values()))
            if not dirs:
                raise invalid_arg(f"model '{record.name}' has no version folders (numeric names) in {path}")
            wanted = set(select_versions(config.version_policy, list(dirs))) | (record.pinned & set(dirs))
            if not wanted:  # Triton's refusal (a `specific` policy naming no existing folder, say)
                raise invalid_arg(f"at least one version must be available under the version policy of model "
                                  f"'{record.name}'")
            wanted -= record.excluded
            spec = await loop.run_in_executor(None, model_config.build_spec, config, path)
            entry = backend_registry.lookup(spec.platform, spec.backend)
            weights = parse_weights(config.parameters[WEIGHTS_PARAMETER].string_value) \
                if WEIGHTS_PARAMETER in config.parameters else None
            deps = dependencies(config)
        except PierError as exc:
            record.disk_fingerprint = self._disk_fingerprint(record, src)
            return self._fail(record, exc.message)
        if deps:
            error = await self._load_dependencies(record, deps, sources, chain)
            if error:
                return self._fail(record, error)
        config_fp = hashlib.sha256(config.SerializeToString(deterministic=True)).hexdigest()
        targets: dict[int, str] = {}
        for v in sorted(wanted):
            fp = config_fp + _tree_fingerprint(dirs[v])
            vr = record.versions.get(v)
            if force or vr is None or vr.loaded is None or vr.state is not ModelState.READY or vr.fingerprint != fp:
                targets[v] = fp
        for v in targets:
            vr = record.versions.setdefault(v, VersionRecord(ModelState.LOADING))
            if vr.loaded is None:
                vr.state, vr.reason = ModelState.LOADING, ""
        results = await asyncio.gather(*(self._load_version(record, entry, spec, config, path, v) for v in targets))
        loaded = {v: r for v, r in zip(targets, results) if isinstance(r, LoadedModel)}
        failed = {v: r for v, r in zip(targets, results) if isinstance(r, str)}
        if failed:
            # Triton: if any version fails, the newly loaded ones are dropped and the old keep serving.
            for m in loaded.values():
                self._spawn_stop(m)
            for v, reason in failed.items():
                vr = record.versions[v]
                if vr.loaded is None:
                    vr.state, vr.reason = ModelState.UNAVAILABLE, reason
            for v in loaded:
                vr = record.versions[v]
                if vr.loaded is None:
                    vr.state, vr.reason = ModelState.UNAVAILABLE, "not loaded: another version of the model failed"
            record.disk_fingerprint = disk_fp
            return "; ".join(f"version {v}: {r}" for v, r in sorted(failed.items()))
        # Switch: new versions serve from here on; replaced and unwanted ones drain and retire.
        for v, model in loaded.items():
            vr = record.versions[v]
            old = vr.loaded
            vr.loaded, vr.state, vr.reason, vr.fingerprint = model, ModelState.READY, "", targets[v]
            if old is not None:
                self._spawn_stop(old)
            log.info("loaded '%s' version %d%s", record.name, v, " (reloaded)" if old is not None else "")
        for v in list(record.versions):
            if v not in wanted:
                self._retire(record, v)
        record.error, record.disk_fingerprint, record.removed = "", disk_fp, False
        if weights is not None:
            record.weights = weights
        self._refresh_routes(record)
        return ""

    def _fail(self, record: ModelRecord, reason: str) -> str:
        """A model-level failure: reported; versions that serve keep serving."""
        if not record.ready():
            record.error = reason
            for vr in record.versions.values():
                if vr.loaded is None and vr.state is ModelState.LOADING:
                    vr.state, vr.reason = ModelState.UNAVAILABLE, reason
        log.error("failed to load '%s': %s", record.name, reason)
        return reason

    async def _load_dependencies(self, record: ModelRecord, deps: list[str],
                                 sources: dict[str, source.ModelSource] | None, chain: tuple[str, ...]) -> str:
        """Ensembles: load the composing models that are not loaded yet (explicit mode)."""
        for dep in deps:
            if dep in chain:
                return f"ensemble dependency cycle: {' -> '.join((*chain, dep))}"
            dep_record = self._models.get(dep)
            if dep_record is not None and dep_record.ready():
                continue
            try:
                await self.load(dep, sources=sources, _chain=chain)
            except PierError as exc:
                return f"composing model '{dep}' failed to load: {exc.message}"
            record.dependents.add(dep)
        return ""

    def _materialize(self, record: ModelRecord, src: source.ModelSource | None,
                     override: LoadOverride | None) -> Path:
        """The folder this load reads: the repository's, or a temporary one holding the files a
        load request sent. Blocking (writes files)."""
        if override is not None and override.files:  # the control plane checked they come with a config
            tmp = Path(tempfile.mkdtemp(prefix=f"pier-{record.name}-"))
            root = (tmp / record.name).resolve()
            for rel, content in override.files.items():
                target = (root / rel).resolve()
                if not target.is_relative_to(root):  # check_file_parameter refused it already
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise invalid_arg(f"invalid file parameter 'file:{rel}'")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            self._drop_override(record)
            record.override_dir, record.override = root, override
            return root
        if src is None:
            if (override is None or not override.files) and record.override_dir is not None:
                return record.override_dir  # a per-version call on a model loaded from a request
            raise invalid_arg("model not found in any model repository")
        self._drop_override(record)
        record.override = override if override is not None and override.config_json else None
        return src.path

    @staticmethod
    def _drop_override(record: ModelRecord) -> None:
        if record.override_dir is not None:
            shutil.rmtree(record.override_dir.parent, ignore_errors=True)
            record.override_dir, record.override = None, None

    def _read_config(self, name: str, path: Path, override: LoadOverride | None,
                     dirs: list[Path]) -> mc.ModelConfig:
        config_path = source.config_file(path, self._config_name)
        if override is not None and override.config_json:
            raw = model_config.parse_config_json(override.config_json, f"the 'config' parameter of '{name}'")
            origin = f"the 'config' parameter of '{name}'"
        elif config_path.exists():
            raw, origin = model_config.parse_config_file(config_path), str(config_path)
        elif self._auto_complete:
            raw, origin = mc.ModelConfig(), str(config_path)
        else:
            raise invalid_arg(f"model '{name}' has no config.pbtxt and auto-complete is disabled")
        return model_config.complete_config(raw, name, dirs, origin, self._auto_complete, _describe)

    async def _load_version(self, record: ModelRecord, entry: backend_registry.BackendEntry, spec: ModelSpec,
                            config: mc.ModelConfig, path: Path, version: int) -> LoadedModel | str:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        if entry is backend_registry.ENSEMBLE:
            return self._load_ensemble(spec, config, version)
        async with self._load_slots:
            try:
                backend = backend_registry.get_backend(entry)
                instances = await loop.run_in_executor(
                    None, create_instances, backend, spec, version, path, self._gpus, self.services)
            except PierError as exc:
                return exc.message
            except Exception as exc:  # a backend failing to load must not take the server down
                return f"{type(exc).__name__}: {exc}"
            try:
                warmups = await loop.run_in_executor(None, warm_up, config, spec, path, instances)
            except PierError as exc:
                for inst in instances:
                    inst.close()
                return exc.message
        model = build_loaded_model(spec, config, version, instances, self._keep_recent)
        record_warmup(model.stats, warmups)
        model.load_duration_s = time.perf_counter() - start
        return model

    def _load_ensemble(self, spec: ModelSpec, config: mc.ModelConfig, version: int) -> LoadedModel | str:
        if self.services is None:
            return "ensembles need the data plane, which is not running"
        try:
            plan = build_plan(config, spec, self._spec_of)
            spec = self._inherit_labels(spec, plan)
        except PierError as exc:
            return exc.message
        if plan.decoupled and not config.model_transaction_policy.decoupled:  # as Triton marks such an ensemble
            config = mc.ModelConfig.FromString(config.SerializeToString())
            config.model_transaction_policy.decoupled = True
            spec = dataclasses.replace(spec, decoupled=True, config_json=model_config.config_to_json(config))
        stats = ModelStatistics.create(self._keep_recent)
        scheduler = EnsembleScheduler(plan, self.services.infer_async, stats, self.services.infer_stream_async)
        return LoadedModel(spec, config, version, scheduler, stats)

    def _inherit_labels(self, spec: ModelSpec, plan: EnsemblePlan) -> ModelSpec:
        """An ensemble output without a label_filename classifies with the labels of the composing
        model output it comes from, as Triton does (its responses are the composing model's)."""
        labels = dict(spec.labels)
        for step in plan.steps:
            for model_output, tensor in step.outputs:
                if tensor not in labels and spec.output(tensor) is not None:
                    inherited = self._spec_of(step.model, step.version).labels.get(model_output)
                    if inherited:
                        labels[tensor] = inherited
        return spec if labels == spec.labels else dataclasses.replace(spec, labels=labels)

    def _spec_of(self, name: str, version: str) -> ModelSpec:
        """The spec requests to (name, version) would use now (ensemble validation)."""
        record = self._models.get(name)
        ready = record.ready() if record is not None else {}
        if not ready:
            raise not_found(f"model '{name}' has no READY version")
        if version:
            if int(version) not in ready:
                raise not_found(f"version {version} of model '{name}' is not READY")
            return ready[int(version)].spec
        return ready[max(ready)].spec

    def _retire(self, record: ModelRecord, version: int) -> None:
        """Stop routing to `version`; it finishes its in-flight requests, then unloads."""
        vr = record.versions.get(version)
        if vr is None:
            return
        model, vr.loaded = vr.loaded, None
        if model is None:
            if vr.state is not ModelState.UNLOADING:
                vr.state, vr.reason = ModelState.UNAVAILABLE, UNLOADED
            return
        vr.state, vr.reason, vr.draining, vr.fingerprint = ModelState.UNLOADING, "", model, ""
        record.weights.pop(version, None)

        async def finish() -> None:
            try:
                await model.stop()
            finally:
                if vr.draining is model:
                    vr.draining = None
                    if vr.loaded is None and vr.state is ModelState.UNLOADING:
                        vr.state, vr.reason = ModelState.UNAVAILABLE, UNLOADED
                log.info("unloaded '%s' version %d", record.name, version)

        self._track(finish())

    def _spawn_stop(self, model: LoadedModel) -> None:
        self._track(model.stop())

    def _track(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _refresh_routes(self, record: ModelRecord) -> None:
        ready = record.ready()
        record.newest = ready[max(ready)] if ready else None
        weights = {v: w for v, w in record.weights.items() if v in ready and w > 0}
        if record.weights and not weights:
            log.info("traffic for '%s': weighted versions are gone, back to the newest READY version", record.name)
            record.weights = {}
        models, cumulative, total = [], [], 0.0
        for v in sorted(weights):
            total += weights[v]
            models.append(ready[v])
            cumulative.append(total)
        record.route_models, record.route_cumulative = models, cumulative
