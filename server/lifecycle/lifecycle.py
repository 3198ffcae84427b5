"""The per-version life cycle: load -> warm up -> READY -> drain -> retire, as Triton's model
lifecycle. A new version loads and warms while what serves keeps serving; the switch is atomic;
a version that stops taking traffic finishes its in-flight requests, then unloads. Every change
publishes the model's routing snapshot (pier.lifecycle.routing), which is all that requests read.

The repository manager decides what should serve (pier.control.manager); this module makes
it so, and owns the rollout weights."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from pier.contract.backend import LoadProgress, ServerServices
from pier.contract.errors import PierError, invalid_arg, not_found
from pier.contract.types import ModelSpec
from pier.lifecycle.loaded_model import LoadedModel, build_loaded_model, create_instances, instance_contexts
from pier.lifecycle.routing import Route, RoutingTable
from pier.lifecycle.state import ModelState
from pier.lifecycle.warmup import record_warmup, warm_up
from pier.observability.progress import LoadProgressView
from pier.observability.statistics import ModelStatistics
from pier.protocol import model_config_pb2 as mc
from pier.repository import backend_registry, source
from pier.repository.disk import ModelOnDisk
from pier.scheduling.ensemble import EnsemblePlan, EnsembleScheduler, build_plan

log = logging.getLogger("pier.repository")

UNLOADED = "unloaded"


def gpu_count() -> int:
    """GPUs visible to this process (device nodes; no CUDA library needed to count)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


@dataclass
class VersionRecord:
    state: ModelState
    reason: str = ""
    loaded: LoadedModel | None = None
    fingerprint: str = ""  # of the completed config + the version folder, when loaded
    draining: LoadedModel | None = None


@dataclass
class ModelVersions:
    """The life cycle's record of one model."""

    name: str
    error: str = ""  # model-level failure (bad config, no versions)
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)  # rollout; empty = newest READY

    def ready(self) -> dict[int, LoadedModel]:
        return {v: vr.loaded for v, vr in self.versions.items()
                if vr.state is ModelState.READY and vr.loaded is not None}


class ModelLifecycle:
    """Versions of every model, their states, and the routing snapshots built from them.
    `services`: the data plane as models see it (BLS, ensembles), given to every backend."""

    def __init__(self, routes: RoutingTable, services: ServerServices, load_concurrency: int = 4,
                 keep_recent: bool = False) -> None:
        self._routes = routes
        self._services = services
        self._keep_recent = keep_recent  # statistics keep recent requests (the summary metrics need them)
        self._models: dict[str, ModelVersions] = {}
        self._load_slots = asyncio.Semaphore(max(load_concurrency, 1))
        self._gpus = gpu_count()
        self._retiring: set[asyncio.Task[Any]] = set()
        self._progress = LoadProgressView()

    def model(self, name: str) -> ModelVersions:
        record = self._models.get(name)
        if record is None:
            record = self._models[name] = ModelVersions(name)
        return record

    def get(self, name: str) -> ModelVersions | None:
        return self._models.get(name)

    def records(self) -> list[ModelVersions]:
        return list(self._models.values())

    def ready(self, name: str) -> dict[int, LoadedModel]:
        record = self._models.get(name)
        return record.ready() if record is not None else {}

    # ---- bringing versions up and down ---------------------------------------------------

    async def apply(self, record: ModelVersions, disk: ModelOnDisk, force: bool) -> str:
        """Serve `disk.wanted`: (re)load the versions that are new or changed (all of them when
        `force`) beside what serves, then switch and retire what is no longer wanted. Returns ""
        or why it failed; on failure what served before keeps serving."""
        targets = {}
        for v, fp in disk.fingerprints.items():
            vr = record.versions.get(v)
            if force or vr is None or vr.loaded is None or vr.state is not ModelState.READY or vr.fingerprint != fp:
                targets[v] = fp
        for v in targets:
            vr = record.versions.setdefault(v, VersionRecord(ModelState.LOADING))
            if vr.loaded is None:
                vr.state, vr.reason = ModelState.LOADING, ""
        self.publish(record)
        results = await asyncio.gather(*(self._load_version(record.name, disk, v) for v in targets))
        for v in targets:
            self._progress.finish(_load_label(record.name, v))
        loaded = {v: r for v, r in zip(targets, results) if isinstance(r, LoadedModel)}
        failed = {v: r for v, r in zip(targets, results) if isinstance(r, str)}
        if failed:
            # Triton: if any version fails, the newly loaded ones are dropped and the old keep serving.
            for m in loaded.values():
                self._track(m.stop())
            for v, reason in failed.items():
                vr = record.versions[v]
                if vr.loaded is None:
                    vr.state, vr.reason = ModelState.UNAVAILABLE, reason
            for v in loaded:
                vr = record.versions[v]
                if vr.loaded is None:
                    vr.state, vr.reason = ModelState.UNAVAILABLE, "not loaded: another version of the model failed"
            self.publish(record)
            return "; ".join(f"version {v}: {r}" for v, r in sorted(failed.items()))
        # Switch: new versions serve from here on; replaced and unwanted ones drain and retire.
        for v, model in loaded.items():
            vr = record.versions[v]
            old = vr.loaded
            vr.loaded, vr.state, vr.reason, vr.fingerprint = model, ModelState.READY, "", targets[v]
            if old is not None:
                self._track(old.stop())
            log.info("loaded '%s' version %d%s", record.name, v, " (reloaded)" if old is not None else "")
        for v in list(record.versions):
            if v not in disk.wanted:
                self._retire(record, v)
        record.error = ""
        if disk.weights is not None:
            record.weights = disk.weights
        self.publish(record)
        return ""

    def fail(self, record: ModelVersions, reason: str) -> str:
        """A model-level failure: reported; versions that serve keep serving."""
        if not record.ready():
            record.error = reason
            for vr in record.versions.values():
                if vr.loaded is None and vr.state is ModelState.LOADING:
                    vr.state, vr.reason = ModelState.UNAVAILABLE, reason
        log.error("failed to load '%s': %s", record.name, reason)
        self.publish(record)
        return reason

    def retire(self, record: ModelVersions, versions: list[int] | None = None) -> None:
        """Stop routing to `versions` (default all); each drains in the background, then unloads."""
        for v in list(record.versions) if versions is None else versions:
            self._retire(record, v)
        self.publish(record)

    def forget_error(self, record: ModelVersions) -> None:
        """A failed load that was unloaded no longer counts (readiness, the index)."""
        record.error = ""
        self.publish(record)

    async def drain(self) -> None:
        """Wait until every retiring version has unloaded."""
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    def _retire(self, record: ModelVersions, version: int) -> None:
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

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _load_version(self, key: str, disk: ModelOnDisk, version: int) -> LoadedModel | str:
        loaded = await self._load_one(key, disk, version)
        if isinstance(loaded, LoadedModel):
            loaded.key = key
        return loaded

    async def _load_one(self, key: str, disk: ModelOnDisk, version: int) -> LoadedModel | str:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        if disk.entry is backend_registry.ENSEMBLE:
            return self._load_ensemble(key, disk.spec, disk.config, version)
        health = _HealthBoard(self, key, version, loop)
        async with self._load_slots:
            try:
                backend = backend_registry.get_backend(disk.entry)
                instances = await loop.run_in_executor(
                    None, create_instances, backend, disk.spec, disk.config, version, disk.path, self._gpus,
                    self._services, health.report, health.progress)
            except PierError as exc:
                return exc.message
            except Exception as exc:  # a backend failing to load must not take the server down
                return f"{type(exc).__name__}: {exc}"
            try:
                warmups = await loop.run_in_executor(None, warm_up, disk.config, disk.spec, disk.path, instances)
            except PierError as exc:
                for inst in instances:
                    inst.close()
                return exc.message
        names = [where.name for where in instance_contexts(disk.spec, self._gpus)]
        model = build_loaded_model(disk.spec, disk.config, version, instances, self._keep_recent, names)
        health.model = model
        record_warmup(model.stats, warmups)
        model.load_duration_s = time.perf_counter() - start
        return model

    def _load_ensemble(self, key: str, spec: ModelSpec, config: mc.ModelConfig, version: int) -> LoadedModel | str:
        ns = source.namespace(key)

        def qualified(name: str) -> str:  # --model-namespacing: the ensemble's own namespace first
            return f"{ns}/{name}" if ns else name

        try:
            plan = build_plan(config, spec, lambda name, v: self._spec_of(qualified(name), v))
            plan = dataclasses.replace(plan, steps=tuple(dataclasses.replace(s, model=qualified(s.model))
                                                         for s in plan.steps))
            spec = self._inherit_labels(spec, plan)
        except PierError as exc:
            return exc.message
        if plan.decoupled and not config.model_transaction_policy.decoupled:  # as Triton marks such an ensemble
            config = mc.ModelConfig.FromString(config.SerializeToString())
            config.model_transaction_policy.decoupled = True
            spec = dataclasses.replace(spec, decoupled=True)
        stats = ModelStatistics.create(self._keep_recent)
        scheduler = EnsembleScheduler(plan, self._services.infer_async, stats, self._services.infer_stream_async)
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
        try:
            name = self._routes.key(name)  # --model-namespacing: the namespace that holds it
        except PierError:
            pass
        ready = self.ready(name)
        name = source.model_name(name)
        if not ready:
            raise not_found(f"model '{name}' has no READY version")
        if version:
            if int(version) not in ready:
                raise not_found(f"version {version} of model '{name}' is not READY")
            return ready[int(version)].spec
        return ready[max(ready)].spec

    def health_changed(self, key: str, version: int, model: LoadedModel, sick: dict[str, str]) -> None:
        """On the event loop: `model`'s instances in `sick` cannot serve (instance -> reason).
        With all of them sick the version is UNAVAILABLE with their reason; once one serves again
        it is READY. Reports about a load that no longer serves (reloaded, unloaded) are ignored."""
        record = self._models.get(key)
        vr = record.versions.get(version) if record is not None else None
        if record is None or vr is None or vr.loaded is not model:
            return
        down = bool(sick) and len(sick) >= max(len(model.instances), 1)
        reason = "; ".join(sorted(set(sick.values())))
        if down and vr.state is ModelState.READY:
            vr.state, vr.reason = ModelState.UNAVAILABLE, reason
            log.error("'%s' version %d is UNAVAILABLE: %s", record.name, version, vr.reason)
        elif down and vr.state is ModelState.UNAVAILABLE and vr.reason != reason:  # e.g. how its restart goes
            vr.reason = reason
        elif not down and vr.state is ModelState.UNAVAILABLE:
            vr.state, vr.reason = ModelState.READY, ""
            log.info("'%s' version %d is READY again", record.name, version)
        else:
            return
        self.publish(record)

    def load_progress(self, key: str, version: int, progress: LoadProgress) -> None:
        """On the event loop: a version being loaded has come this far. While it is LOADING its
        reason says so (the index, model ready, the status page); the terminal or log shows it."""
        record = self._models.get(key)
        vr = record.versions.get(version) if record is not None else None
        if vr is None or vr.state is not ModelState.LOADING:
            return  # a reload beside a READY version keeps its reason; a restart's reload is the health's
        vr.reason = str(progress)
        self._progress.update(_load_label(key, version), progress)

    # ---- routing -------------------------------------------------------------------------

    def publish(self, record: ModelVersions) -> None:
        """Publish `record`'s routing snapshot (weights whose versions are gone fall back to the
        newest READY version)."""
        ready = record.ready()
        if record.weights and not any(v in ready and w > 0 for v, w in record.weights.items()):
            log.info("traffic for '%s': weighted versions are gone, back to the newest READY version", record.name)
            record.weights = {}
        why = "; ".join(f"version {v} is {vr.state.value}: {vr.reason}" for v, vr in sorted(record.versions.items())
                        if vr.state is not ModelState.READY and vr.reason)
        self._routes.publish(Route.build(record.name, frozenset(record.versions), ready, record.weights,
                                         failed=bool(record.error), healthy=_healthy(record), why=why))

    def set_weights(self, name: str, weights: dict[int, float]) -> dict[int, float]:
        """Split unversioned traffic over READY versions; {} goes back to newest READY."""
        record = self._models.get(name)
        ready = record.ready() if record is not None else {}
        if record is None or not ready:
            raise not_found(f"model '{name}' has no READY version to route traffic to")
        for v, w in weights.items():
            if not math.isfinite(w) or w < 0:
                raise invalid_arg(f"traffic weight for version {v} of '{name}' must be a finite number >= 0, got {w}")
            if v not in ready:
                raise invalid_arg(f"version {v} of model '{name}' is not READY: it cannot take traffic")
        if weights and sum(weights.values()) <= 0:
            raise invalid_arg(f"traffic weights for '{name}' must not all be zero")
        record.weights = {v: w for v, w in weights.items() if w > 0}
        self.publish(record)
        log.info("traffic for '%s': %s", name, self.describe_traffic(name) or "newest READY version")
        return self.traffic(name)

    def rollback(self, name: str, version: int | None = None) -> dict[int, float]:
        """All traffic to `version`, or to the newest READY version older than the newest one
        taking traffic now."""
        ready = self.ready(name)
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
        route = self._routes.route(name)
        if name not in self._models or route is None:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        return route.traffic()

    def describe_traffic(self, name: str) -> str:
        route = self._routes.route(name)
        if route is None or not route.weighted:
            return ""
        return ", ".join(f"v{v} {p:g}%" for v, p in route.traffic().items())

    # ---- what the metrics and the index read ---------------------------------------------

    def metered_models(self) -> list[LoadedModel]:
        """What the metrics report: the loaded versions, and those still draining their in-flight
        requests while they unload (as Triton keeps their series until the unload ends)."""
        return [m for r in self._models.values() for vr in r.versions.values() if (m := vr.loaded or vr.draining)]

    def status_table(self) -> list[tuple[str, str, str]]:
        rows = []
        for name in sorted(self._models):
            record = self._models[name]
            if not record.versions and record.error:
                rows.append((name, "-", f"UNAVAILABLE: {record.error}"))
            for v, vr in sorted(record.versions.items()):
                rows.append((name, str(v), vr.state.value + (f": {vr.reason}" if vr.reason else "")))
        return rows


def _healthy(record: ModelVersions) -> bool:
    """Strict readiness of one model: asked for, it has a version and none failed (versions
    unloaded on purpose, loading or draining do not count against it)."""
    if not record.versions and not record.error:
        return True  # never asked to load (explicit mode): not part of readiness
    if record.error and not record.ready():
        return False
    return not any(vr.state is ModelState.UNAVAILABLE and vr.reason != UNLOADED for vr in record.versions.values())


def _load_label(key: str, version: int) -> str:
    return f"'{source.model_name(key)}' version {version}"


class _HealthBoard:
    """One load's instance health reports (ModelContext.report_health), from any thread, applied
    to the life cycle on the event loop once the load is built; and its progress reports
    (ModelContext.report_progress), applied at once."""

    def __init__(self, lifecycle: ModelLifecycle, key: str, version: int, loop: asyncio.AbstractEventLoop) -> None:
        self._lifecycle, self._key, self._version, self._loop = lifecycle, key, version, loop
        self.model: LoadedModel | None = None
        self._sick: dict[str, str] = {}

    def report(self, instance: str, reason: str | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._apply, instance, reason)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def progress(self, instance: str, progress: LoadProgress) -> None:
        try:
            self._loop.call_soon_threadsafe(self._lifecycle.load_progress, self._key, self._version, progress)
        except RuntimeError:
            pass

    def _apply(self, instance: str, reason: str | None) -> None:
        if reason:
            self._sick[instance] = reason
            if self.model is not None:
                self.model.instance_lost(instance)
        else:
            self._sick.pop(instance, None)
        if self.model is not None:
            self._lifecycle.health_changed(self._key, self._version, self.model, dict(self._sick))
