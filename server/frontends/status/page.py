"""`GET /` (the status page: HTML, CSS and JS shipped in this package's assets/, no CDN) and
`GET /api/status` (the JSON the page polls; docs/status-and-api.md documents it).

The page shows nothing a caller could not read through the API: API keys guard both paths as
they guard every other one (a browser can answer with HTTP Basic, the key as the password), and
under --http-restricted-api each part of the document is present only when the request carries
the header of the API category that serves the same facts: the models and their states and
rollout weights (model-repository: the repository index and traffic), queue, in-flight,
throughput, latency and the LLM engine's figures (statistics), instance counts and execution
mode (model-config), the server's version and settings (metadata). What was left out is named in
`withheld`."""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from pier.contract.errors import PierError
from pier.control.plane import ControlPlane
from pier.dataplane.plane import DataPlane
from pier.frontends.restrictions import Rules
from pier.frontends.status.history import INTERVAL_S, WINDOW_S, History
from pier.lifecycle.lifecycle import ModelLifecycle
from pier.lifecycle.loaded_model import LoadedModel
from pier.settings import Settings

_ASSETS = {"status.js": "text/javascript", "status.css": "text/css"}


def _asset(name: str) -> bytes:
    return resources.files("pier.frontends.status").joinpath("assets", name).read_bytes()


def _settings(s: Settings) -> dict[str, Any]:
    """The settings an operator looks for first (never a secret: whether keys are on, not the keys)."""
    return {
        "model_repositories": [str(p) for p in s.model_repositories],
        "serve_path": None if s.serve_path is None else str(s.serve_path),
        "model_control_mode": s.model_control_mode,
        "ports": {"http": s.http_port if s.allow_http else None, "grpc": s.grpc_port if s.allow_grpc else None,
                  "metrics": s.metrics_port if s.allow_metrics else None},
        "frontend_processes": s.frontend_processes,
        "strict_readiness": s.strict_readiness,
        "exit_timeout_secs": s.exit_timeout_secs,
        "api_keys": bool(s.api_keys),
        "rate_limits": list(s.rate_limit_model) + ([f"per key {s.rate_limit_key}"] if s.rate_limit_key else []),
        "response_cache_bytes": s.response_cache_bytes,
        "trace_config": list(s.trace_config),
        "restricted_apis": sorted({c for spec in s.http_restricted_api for c in spec.partition(":")[0].split(",")}),
    }


def _execution(m: LoadedModel) -> dict[str, Any]:
    spec = m.spec
    if spec.platform == "ensemble":
        scheduler = "ensemble"
    elif spec.sequence is not None:
        scheduler = "sequence batching"
    elif spec.batching is not None:
        scheduler = "dynamic batching"
    else:
        scheduler = "direct"
    if spec.backend == "python":
        mode = "stub process per instance" if spec.parameters.get("execution_mode", "process") == "process" \
            else "in the server process"
    elif spec.backend == "llm":
        mode = "engine core in its own process" if spec.parameters.get("engine_core", "process") == "process" \
            else "engine core on a server thread"
    else:
        mode = "worker threads in the server process"
    return {"backend": spec.api_platform, "scheduler": scheduler, "mode": mode,
            "max_batch_size": spec.max_batch_size, "decoupled": spec.decoupled,
            "instances": [{"kind": g.kind, "count": g.count} for g in spec.instance_groups]}


class StatusPage:
    """Built by the server (server/app.py); `run` samples the history until the server stops."""

    def __init__(self, settings: Settings, plane: DataPlane, control: ControlPlane, lifecycle: ModelLifecycle) -> None:
        self._settings = _settings(settings)
        self._plane = plane
        self._control = control
        self._lifecycle = lifecycle
        self._started = time.time()
        self.history = History(lifecycle.metered_models)

    def add_routes(self, app: web.Application, rules: Rules) -> None:
        self._rules = rules
        app.router.add_get("/", self._page)
        app.router.add_get("/api/status", self._status)
        for name in _ASSETS:
            app.router.add_get(f"/static/{name}", self._static)

    def _allowed(self, request: web.Request, category: str) -> bool:
        rule = self._rules.get(category)
        return rule is None or request.headers.get(rule[0]) == rule[1]

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(body=_asset("status.html"), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def _static(self, request: web.Request) -> web.Response:
        name = request.path.rsplit("/", 1)[-1]
        return web.Response(body=_asset(name), content_type=_ASSETS[name], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def _status(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(await self.document(request)), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def document(self, request: web.Request) -> dict[str, Any]:
        allowed = {c: self._allowed(request, c) for c in ("model-repository", "statistics", "model-config",
                                                          "metadata")}
        doc: dict[str, Any] = {"refresh_s": INTERVAL_S, "window_s": WINDOW_S,
                               "withheld": sorted(c for c, ok in allowed.items() if not ok)}
        if allowed["metadata"]:
            meta = self._plane.server_metadata()
            doc["server"] = {"name": meta["name"], "version": meta["version"],
                             "uptime_s": round(time.time() - self._started, 1),
                             "ready": self._plane.ready(), "exiting": self._plane.exiting,
                             "settings": self._settings}
        if allowed["model-repository"]:
            doc["models"] = await self._models(allowed["statistics"], allowed["model-config"])
        return doc

    async def _models(self, stats: bool, config: bool) -> list[dict[str, Any]]:
        rows = await self._control.index()
        loaded = {(m.spec.name, m.version_str): m for m in self._lifecycle.metered_models()}
        in_flight = self._plane.in_flight()
        models: list[dict[str, Any]] = []
        for row in rows:
            entry: dict[str, Any] = {"name": row["name"], "version": row.get("version"),
                                     "state": row.get("state", "NOT LOADED"), "reason": row.get("reason", "")}
            m = loaded.get((row["name"], row.get("version", "")))
            if m is not None:
                try:
                    entry["traffic_percent"] = self._lifecycle.traffic(m.key).get(m.version, 0.0)
                except PierError:  # a model that went away since the index was read
                    entry["traffic_percent"] = None
                if config:
                    entry["execution"] = _execution(m)
                if stats:
                    entry["stats"] = self._stats(m, in_flight.get(m.load_id, 0))
            models.append(entry)
        return models

    def _stats(self, m: LoadedModel, in_flight: int) -> dict[str, Any]:
        series, llm = self.history.series(m)
        s = m.stats
        out: dict[str, Any] = {"queue": m.scheduler.pending_count(), "in_flight": in_flight,
                               "success": s.success.count, "failure": s.fail.count,
                               "inference_count": s.inference_count, "execution_count": s.execution_count,
                               "series": series}
        if llm is not None:
            out["llm"] = {"kv_cache_usage": llm.gauges.get("kv_cache_usage_perc"),
                          "running": llm.gauges.get("num_requests_running"),
                          "waiting": llm.gauges.get("num_requests_waiting"),
                          "adapters": []}  # LoRA adapters: none load yet (the engine serves base weights)
        return out
