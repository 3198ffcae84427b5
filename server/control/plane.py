"""Repository operations behind the HTTP and gRPC repository APIs and `pier model`: index,
load/unload (Triton's extension), per-version load/unload, rollout and rollback (Pier's).
Checks what the control mode allows, decodes load parameters, and leaves the work to the
RepositoryManager (what should serve) and the model life cycle (rollout weights). Takes and
returns plain Python values only."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from pier.contract.errors import invalid_arg, unavailable
from pier.control.manager import RepositoryManager
from pier.repository.disk import LoadOverride, check_file_parameter
from pier.repository.source import is_version

FILE_PREFIX = "file:"


async def _to_the_end(operation: Coroutine[Any, Any, None]) -> None:
    """Run a load/unload to completion even when the caller is cancelled (a client that disconnects
    or times out): stopping one half-way would leave the repository in between states."""
    task = asyncio.ensure_future(operation)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody waits: mark it seen
        raise


class ControlPlane:
    def __init__(self, manager: RepositoryManager, mode: str) -> None:
        self._manager = manager
        self._mode = mode

    def _require(self, modes: tuple[str, ...]) -> None:
        if self._mode in modes:
            return
        # Triton 2.51 says this in both none and poll modes (503); Pier adds which mode it is.
        raise unavailable(f"explicit model load / unload is not allowed if polling is enabled (model control mode "
                          f"is '{self._mode}'; start the server with --model-control-mode=explicit)")

    async def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return await self._manager.index(ready_only)

    async def load(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        """Triton's load: `config` (ModelConfig JSON, replaces config.pbtxt) and
        `file:<path>` (file contents as bytes, inside the model folder) parameters; others are refused."""
        self._require(("explicit",))
        _check_name(name)
        override = None
        if parameters:
            override = LoadOverride()
            for key, value in parameters.items():
                if key == "config":
                    if not isinstance(value, str):
                        raise invalid_arg("load parameter 'config' must be a string holding the model "
                                          "configuration as JSON")
                    override.config_json = value
                elif key.startswith(FILE_PREFIX):
                    if not isinstance(value, bytes):
                        raise invalid_arg(f"load parameter '{key}' must carry the file content (base64 over HTTP, "
                                          "bytes_param over gRPC)")
                    check_file_parameter(key[len(FILE_PREFIX):])
                    override.files[key[len(FILE_PREFIX):]] = value
                else:
                    raise invalid_arg(f"unexpected load parameter '{key}': expected 'config' or "
                                      "'file:<path>'")
            if override.files and not override.config_json:
                raise invalid_arg(f"failed to load '{name}': model files in a load request need the 'config' "
                                  "parameter too")
            if not override.config_json:
                override = None
        await _to_the_end(self._manager.load(name, override))

    async def unload(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        self._require(("explicit",))
        _check_name(name)
        dependents = False
        for key, value in (parameters or {}).items():
            if key != "unload_dependents":
                raise invalid_arg(f"unexpected unload parameter '{key}': expected 'unload_dependents'")
            if not isinstance(value, bool):
                raise invalid_arg("unload parameter 'unload_dependents' must be a boolean")
            dependents = value
        await _to_the_end(self._manager.unload(name, unload_dependents=dependents))

    async def load_version(self, name: str, version: str) -> None:
        self._require(("explicit", "poll"))
        await _to_the_end(self._manager.load_version(_check_name(name), _version(version)))

    async def unload_version(self, name: str, version: str) -> None:
        self._require(("explicit", "poll"))
        await _to_the_end(self._manager.unload_version(_check_name(name), _version(version)))

    def version_state(self, name: str, version: str = "") -> tuple[str, str] | None:
        """(state, reason) of a model's version (unversioned: its newest), None when unknown: what
        model ready adds to its "not ready" (a load's progress, a failure)."""
        record = self._manager.lifecycle.get(name)
        if record is None or not record.versions or (version and not version.isdigit()):
            return None
        vr = record.versions.get(int(version) if version else max(record.versions))
        return None if vr is None else (vr.state.value, vr.reason)

    def rollout(self, name: str, weights: dict[str, Any] | None = None, version: str | None = None) -> dict[str, Any]:
        """All traffic to `version`, or split by `weights` ({version: weight}); {} = newest READY."""
        _check_name(name)
        if version is not None:
            chosen = {_version(version): 100.0}
        elif weights is not None:
            if not isinstance(weights, dict):
                raise invalid_arg("'weights' must be a JSON object of version -> weight, e.g. {\"2\": 90, \"3\": 10}")
            chosen = {}
            for v, w in weights.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)):
                    raise invalid_arg(f"traffic weight for version {v} must be a number")
                chosen[_version(v)] = float(w)
        else:
            raise invalid_arg("a rollout needs 'version' or 'weights'")
        return self._traffic_doc(name, self._manager.lifecycle.set_weights(name, chosen))

    def rollback(self, name: str, version: str | None = None) -> dict[str, Any]:
        _check_name(name)
        traffic = self._manager.lifecycle.rollback(name, _version(version) if version is not None else None)
        return self._traffic_doc(name, traffic)

    def traffic(self, name: str) -> dict[str, Any]:
        return self._traffic_doc(_check_name(name), self._manager.lifecycle.traffic(name))

    @staticmethod
    def _traffic_doc(name: str, traffic: dict[int, float]) -> dict[str, Any]:
        return {"name": name, "traffic": {str(v): p for v, p in sorted(traffic.items())}}


def _check_name(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise invalid_arg(f"invalid model name '{name}'")
    return name


def _version(value: Any) -> int:
    text = str(value)
    if not is_version(text) or int(text) <= 0:
        raise invalid_arg(f"invalid model version '{text}': versions are positive integers")
    return int(text)
