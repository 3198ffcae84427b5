"""What is wanted: the manager reconciles each model with its folder (or with a load request's
overrides) and hands the result to the life cycle (pier.lifecycle.lifecycle), which loads what
is new or changed while the current versions keep serving, switches atomically and retires
what is no longer wanted. Operations on one model are serialized by a per-model lock;
different models load in parallel. All filesystem work (scans, reads, fingerprints, copies)
runs in an executor (pier.repository.disk), never on the event loop."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pier.contract import llm
from pier.contract.errors import PierError, invalid_arg, not_found
from pier.lifecycle.lifecycle import ModelLifecycle, ModelVersions
from pier.lifecycle.loaded_model import LoadedModel
from pier.lifecycle.state import ModelState
from pier.repository import disk, model_config, source
from pier.repository.disk import LoadOverride

log = logging.getLogger("pier.repository")
T = TypeVar("T")


@dataclass
class ModelEntry:
    """What the repository wants of one model, beside what its folder says."""

    name: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    disk_fingerprint: str = ""  # what the last reconcile saw (poll skips unchanged models)
    pinned: set[int] = field(default_factory=set)  # versions loaded by the per-version API
    excluded: set[int] = field(default_factory=set)  # versions unloaded by the per-version API
    override_dir: Path | None = None  # temporary folder holding files sent in a load request
    override: LoadOverride | None = None
    dependents: set[str] = field(default_factory=set)  # composing models this one loaded
    awaiting: set[str] = field(default_factory=set)  # composing models whose unload took this ensemble down
    removed: bool = False  # its folder is gone (poll): hidden from the index once drained


class RepositoryManager:
    def __init__(self, lifecycle: ModelLifecycle, repositories: list[Path], auto_complete: bool,
                 config_name: str = "", namespacing: bool = False) -> None:
        self.lifecycle = lifecycle
        self._namespacing = namespacing  # --model-namespacing: keys are "<repository>/<name>"
        self._repositories = repositories
        self._config_name = config_name  # --model-config-name: configs/<name>.pbtxt when a model has one
        self._auto_complete = auto_complete
        self._entries: dict[str, ModelEntry] = {}

    def _entry(self, name: str) -> ModelEntry:
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = ModelEntry(name)
        return entry

    @staticmethod
    async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))

    async def _scan(self) -> dict[str, source.ModelSource]:
        return await self._off_loop(source.scan, self._repositories, self._namespacing)

    def _keys(self, name: str, sources: dict[str, source.ModelSource]) -> list[str]:
        """The models a control call names: the name itself, or with namespacing every namespace's
        model of that name (as Triton loads and unloads them all)."""
        if not self._namespacing or name in sources or name in self._entries:
            return [name]
        keys = {k for k in sources if source.model_name(k) == name}
        keys |= {k for k in self._entries if source.model_name(k) == name}
        return sorted(keys) or [name]

    def _dependency_key(self, key: str, dep: str, sources: dict[str, source.ModelSource] | None) -> str:
        """An ensemble's composing model: with namespacing, the one in the ensemble's namespace,
        else the only one of that name (several: the first, and routing reports the ambiguity)."""
        ns = source.namespace(key)
        if not ns:
            return dep
        own = f"{ns}/{dep}"
        known = set(sources or ()) | set(self._entries)
        if own in known and (sources is None or own in sources):
            return own
        others = sorted(k for k in (sources or known) if source.model_name(k) == dep)
        return others[0] if others else own

    # ---- operations ----------------------------------------------------------------------

    async def load_all(self, names: list[str] | None = None) -> list[str]:
        """Load every model in the repositories (or `names`) concurrently; one error line per failure."""
        sources = await self._scan()
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
            sources = await self._scan()
        keys = self._keys(name, sources)
        if len(keys) > 1:  # --model-namespacing: the name is in several namespaces: load each
            for key in keys:
                await self.load(key, override, sources, _chain)
            return
        name = keys[0]
        src = sources.get(name)
        if src is None and (override is None or not override.files):
            raise invalid_arg(f"failed to load '{name}': model not found in any model repository")
        entry = self._entry(name)
        async with entry.lock:
            error = await self._reconcile(entry, src, override, force=override is not None, sources=sources,
                                          chain=(*_chain, name))
        if error:
            raise invalid_arg(f"failed to load '{name}': {error}")
        await self._revive(name)

    async def _revive(self, name: str) -> None:
        """As Triton: an ensemble that went down because `name` was unloaded comes back once
        `name` (and every other composing model it lost) serves again."""
        for entry in [e for e in self._entries.values() if name in e.awaiting]:
            entry.awaiting.discard(name)
            if not entry.awaiting:
                log.info("'%s' is back: reloading the ensemble '%s'", name, entry.name)
                try:
                    await self.load(entry.name)
                except PierError as exc:
                    log.error("%s", exc.message)

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        """Stop routing to every version of `name`; each finishes its in-flight requests in the
        background. Unloading a model that is not loaded succeeds (as Triton)."""
        keys = self._keys(name, {})
        if len(keys) > 1:
            for key in keys:
                await self.unload(key, unload_dependents)
            return
        name = keys[0]
        entry = self._entries.get(name)
        if entry is None:
            return
        async with entry.lock:
            record = self.lifecycle.model(name)
            composing = {d for m in record.ready().values() for d in disk.dependencies(m.config)}
            self.lifecycle.retire(record)
            entry.pinned.clear()
            entry.excluded.clear()
            entry.disk_fingerprint = ""
            self.lifecycle.forget_error(record)
            await self._drop_override(entry)
            dependents, entry.dependents = entry.dependents, set()
            entry.awaiting.clear()  # unloaded on purpose: nothing brings it back
        log.info("unloading '%s'", name)
        # As Triton: an ensemble that composes this model cannot serve without it, so it goes too,
        # and comes back when the model does (`_revive`).
        for other in sorted(self._ensembles_using(name)):
            await self.unload(other)
            self._entry(other).awaiting.add(name)
        if unload_dependents:
            # As Triton: the models this ensemble composes (or whose load it started) go too,
            # unless another loaded ensemble still uses them.
            for dep in sorted(dependents | {self._dependency_key(name, d, None) for d in composing}):
                if not self._ensembles_using(dep):
                    await self.unload(dep, unload_dependents=True)

    def _ensembles_using(self, name: str) -> set[str]:
        """Models with a READY version that is an ensemble composing `name`."""
        return {r.name for r in self.lifecycle.records() if r.name != name
                and any(self._dependency_key(r.name, d, None) == name
                        for m in r.ready().values() for d in disk.dependencies(m.config))}

    async def load_version(self, name: str, version: int) -> None:
        """Serve `version` beside what serves now: the versions serving stay (pinned, as if loaded
        by this API) even when a newer folder on disk would make the version policy pick
        another, so a canary never unloads what it is compared with."""
        entry = self._entry(name)
        async with entry.lock:
            src = None if entry.override_dir else (await self._scan()).get(name)
            path = entry.override_dir or (src.path if src else None)
            if path is None or version not in await self._off_loop(source.version_dirs, path):
                raise not_found(f"failed to load '{name}' version {version}: no such version folder")
            override = LoadOverride(entry.override.config_json) if entry.override else None
            record = self.lifecycle.model(name)
            entry.pinned |= {v for v, vr in record.versions.items() if vr.loaded is not None}
            entry.pinned.add(version)
            entry.excluded.discard(version)
            error = await self._reconcile(entry, src, override, force=False, sources=None, chain=(name,))
        if error:
            raise invalid_arg(f"failed to load '{name}' version {version}: {error}")

    async def unload_version(self, name: str, version: int) -> None:
        entry = self._entries.get(name)
        record = self.lifecycle.get(name)
        if entry is None or record is None or version not in record.versions:
            raise not_found(f"failed to unload '{name}' version {version}: the version is not loaded")
        async with entry.lock:
            entry.excluded.add(version)
            entry.pinned.discard(version)
            self.lifecycle.retire(record, [version])
        log.info("unloading '%s' version %d", name, version)

    async def poll(self) -> list[str]:
        """Apply what changed on disk: new and edited models load, deleted ones unload."""
        sources = await self._scan()
        names = sorted(set(sources) | {n for n, e in self._entries.items() if e.override_dir is None})
        results = await asyncio.gather(*(self._poll_one(n, sources) for n in names))
        return [e for e in results if e]

    async def _poll_one(self, name: str, sources: dict[str, source.ModelSource]) -> str:
        src = sources.get(name)
        if src is None:
            entry, record = self._entries.get(name), self.lifecycle.get(name)
            if entry is not None and record is not None and (record.versions or record.error):
                log.info("model '%s' was removed from the repository", name)
                await self.unload(name)
                entry.removed = True
            return ""
        entry = self._entry(name)
        async with entry.lock:
            if await self._fingerprint(entry, src) == entry.disk_fingerprint:
                return ""
            error = await self._reconcile(entry, src, None, force=False, sources=sources, chain=(name,))
        if error:
            return f"failed to load '{name}': {error}"
        await self._revive(name)
        return ""

    async def unload_all(self) -> None:
        for record in self.lifecycle.records():
            self.lifecycle.retire(record)
        await self.lifecycle.drain()
        for entry in self._entries.values():
            await self._drop_override(entry)

    # ---- the index -----------------------------------------------------------------------

    async def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Repository index rows: one per model version known, name only for never-loaded ones."""
        on_disk = await self._scan()
        rows: list[dict[str, str]] = []
        for name in sorted(set(self._entries) | set(on_disk)):
            entry, record = self._entries.get(name), self.lifecycle.get(name)
            if entry is not None and entry.removed and record is not None and not any(
                    vr.state is not ModelState.UNAVAILABLE for vr in record.versions.values()):
                continue
            if record is None or (not record.versions and not record.error):
                if not ready_only:
                    rows.append({"name": source.model_name(name)})
                continue
            if not record.versions:
                if not ready_only:
                    rows.append({"name": source.model_name(name), "state": "UNAVAILABLE", "reason": record.error})
                continue
            rows.extend(self._version_rows(record, ready_only))
        return rows

    def _version_rows(self, record: ModelVersions, ready_only: bool) -> list[dict[str, str]]:
        split = self.lifecycle.traffic(record.name) if self.lifecycle.describe_traffic(record.name) else {}
        rows = []
        for v, vr in sorted(record.versions.items()):
            if ready_only and vr.state is not ModelState.READY:
                continue
            row = {"name": source.model_name(record.name), "version": str(v), "state": vr.state.value}
            reason = vr.reason
            if vr.state is ModelState.READY and split:
                reason = f"traffic {split.get(v, 0.0):g}%"
            if reason:
                row["reason"] = reason
            rows.append(row)
            if vr.state is ModelState.READY and vr.loaded is not None:
                rows.extend(self._adapter_rows(record.name, str(v), vr.loaded))
        return rows

    def _adapter_rows(self, base: str, version: str, model: LoadedModel) -> list[dict[str, str]]:
        """The LoRA adapters a READY LLM version serves beside itself (lora_modules, multi_lora.json,
        loaded at run time): a row each, under the base's version, READY, the reason naming the base
        and the folder, as the OpenAI `model` field reaches them. A model of the same name wins (as
        there)."""
        info = model.instances[0].info() if model.instances else {}
        adapters = info.get(llm.INFO_LORA_ADAPTERS) or {}
        return [{"name": a, "version": version, "state": ModelState.READY.value,
                 "reason": f"LoRA adapter of '{source.model_name(base)}' ({path})"}
                for a, path in sorted(adapters.items()) if a not in self._entries]

    # ---- reconcile -----------------------------------------------------------------------

    async def _fingerprint(self, entry: ModelEntry, src: source.ModelSource | None) -> str:
        path = entry.override_dir or (src.path if src else None)
        return await self._off_loop(disk.folder_fingerprint, path, self._config_name, set(entry.pinned),
                                    set(entry.excluded))

    async def _reconcile(self, entry: ModelEntry, src: source.ModelSource | None, override: LoadOverride | None,
                         force: bool, sources: dict[str, source.ModelSource] | None, chain: tuple[str, ...]) -> str:
        """Bring `entry` to what its folder (and `override`) asks for. Holds entry.lock.
        Returns "" or the reason it failed (what served before keeps serving)."""
        record = self.lifecycle.model(entry.name)
        if src is not None and src.duplicate_of is not None:
            return self.lifecycle.fail(record, f"model '{entry.name}' exists in two repositories: {src.path} "
                                               f"and {src.duplicate_of}")
        try:
            path = await self._materialize(entry, src, override)
            fingerprint = await self._fingerprint(entry, src)
            on_disk = await self._off_loop(disk.read_model, source.model_name(entry.name), path, override,
                                           self._config_name,
                                           self._auto_complete, set(entry.pinned), set(entry.excluded))
        except PierError as exc:
            entry.disk_fingerprint = await self._fingerprint(entry, src)
            return self.lifecycle.fail(record, exc.message)
        if on_disk.dependencies:
            error = await self._load_dependencies(entry, on_disk.dependencies, sources, chain,
                                                  model_config.base_model(on_disk.config))
            if error:
                return self.lifecycle.fail(record, error)
        error = await self.lifecycle.apply(record, on_disk, force)
        entry.disk_fingerprint = fingerprint
        if not error:
            entry.removed = False
        return error

    async def _load_dependencies(self, entry: ModelEntry, deps: list[str],
                                 sources: dict[str, source.ModelSource] | None, chain: tuple[str, ...],
                                 base: str = "") -> str:
        """Ensembles: load the composing models that are not loaded yet (explicit mode); an LLM
        adapter model (`base`: its base_model) its base, the same way."""
        for name in deps:
            dep = self._dependency_key(entry.name, name, sources)
            if dep in chain:
                kind = "adapter base" if name == base else "ensemble"
                return f"{kind} dependency cycle: {' -> '.join((*chain, dep))}"
            if self.lifecycle.ready(dep):
                continue
            try:
                await self.load(dep, sources=sources, _chain=chain)
            except PierError as exc:
                return f"{'base' if name == base else 'composing'} model '{dep}' failed to load: {exc.message}"
            entry.dependents.add(dep)
        return ""

    async def _materialize(self, entry: ModelEntry, src: source.ModelSource | None,
                           override: LoadOverride | None) -> Path:
        """The folder this load reads: the repository's, or a temporary one holding the files a
        load request sent."""
        if override is not None and override.files:  # the control plane checked they come with a config
            root = await self._off_loop(disk.write_override, source.model_name(entry.name), override.files)
            await self._drop_override(entry)
            entry.override_dir, entry.override = root, override
            return root
        if src is None:
            if (override is None or not override.files) and entry.override_dir is not None:
                return entry.override_dir  # a per-version call on a model loaded from a request
            raise invalid_arg("model not found in any model repository")
        await self._drop_override(entry)
        entry.override = override if override is not None and override.config_json else None
        return src.path

    async def _drop_override(self, entry: ModelEntry) -> None:
        if entry.override_dir is not None:
            root, entry.override_dir, entry.override = entry.override_dir, None, None
            await self._off_loop(disk.remove_override, root)
