"""Composition root: builds the manager, plane and frontends; runs startup, serving and the
shutdown (SIGINT/SIGTERM): close the listeners (a new connection is refused; one opened before
is still served, each answer with `Connection: close`, and gRPC clients get GOAWAY), finish what
is in flight, stop the endpoints, unload, exit 0; all within --exit-timeout-secs, or exit 1 then,
naming what still ran, with every child process killed (`ExitDeadline`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
from aiohttp import web

from pier.contract.errors import PierError
from pier.control.manager import RepositoryManager
from pier.control.plane import ControlPlane
from pier.control.watcher import RepositoryWatcher
from pier.dataplane.plane import DataPlane
from pier.dataplane.response_cache import ResponseCache
from pier.dataplane.services import PlaneServices
from pier.frontends import guards, restrictions
from pier.frontends.grpc.servicer import start_grpc_server
from pier.frontends.http import fastpath
from pier.frontends.http.app import build_app
from pier.frontends.http.middleware import quiet_client_mistakes
from pier.frontends.metrics import CONTENT_TYPE, MetricsConfig, MetricsRenderer
from pier.frontends.status.page import StatusPage
from pier.frontends.workers.pool import FrontendPool
from pier.ipc.child import drop_scratch, kill_all, scratch_folder
from pier.ipc.child import running as child_processes
from pier.lifecycle.lifecycle import ModelLifecycle
from pier.lifecycle.routing import RoutingTable
from pier.observability import log_settings
from pier.observability.tracing import Tracer, parse_trace_config
from pier.repository import single_model
from pier.settings import Settings

log = logging.getLogger("pier")


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _table(rows: list[tuple[str, str, str]]) -> str:
    header = ("Model", "Version", "Status")
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i]) for i in range(3)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    return "\n".join([line, fmt.format(*header), line, *(fmt.format(*r) for r in rows), line])


class PierServer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Built inside the server's event loop (models call back into it from worker threads).
        routes = RoutingTable()  # published by the life cycle, read by the data plane
        self.plane = DataPlane(routes, settings.strict_readiness,
                               Tracer(parse_trace_config(list(settings.trace_config))), settings.server_id,
                               ResponseCache(settings.response_cache_bytes) if settings.response_cache_bytes else None)
        services = PlaneServices(self.plane, asyncio.get_running_loop(), lambda: self.control)
        # keep_recent: the statistics keep a window of recent requests, whose latencies the status
        # page's p50/p99 (and the summary metrics' quantiles) are computed from.
        self.lifecycle = ModelLifecycle(routes, services, settings.model_load_thread_count, keep_recent=True)
        self.manager = RepositoryManager(self.lifecycle, list(settings.model_repositories),
                                         settings.auto_complete_config, config_name=settings.model_config_name,
                                         namespacing=settings.model_namespacing)
        self.control = ControlPlane(self.manager, settings.model_control_mode)
        self._watcher: RepositoryWatcher | None = None
        self._runners: list[web.AppRunner] = []
        self._listeners: list[web.BaseSite] = []  # the client-facing HTTP ports, closed when the drain begins
        self._grpc: grpc.aio.Server | None = None
        self._grpc_closing: asyncio.Future[None] | None = None
        self.phase = "serving"  # what shutdown() is doing, for the exit timeout's log line
        self._frontends: FrontendPool | None = None
        self._socket_dir: Path | None = None
        self.status = StatusPage(settings, self.plane, self.control, self.lifecycle)
        self._status_task: asyncio.Task[None] | None = None

    async def start_endpoints(self) -> None:
        s = self.settings
        metrics = None
        keys = guards.ApiKeys(s.api_keys)
        default_rate, model_rates = guards.parse_model_rates(s.rate_limit_model)
        limiter = guards.RateLimiter(default_rate, model_rates,
                                     guards.parse_rate(s.rate_limit_key, "--rate-limit-key") if s.rate_limit_key
                                     else None)
        if s.allow_metrics:
            renderer = MetricsRenderer(self.lifecycle.metered_models, MetricsConfig.parse(s.metrics_config),
                                       self.lifecycle.traffic, s.allow_cpu_metrics, self.plane.cache)

            async def metrics(request: web.Request) -> web.Response:
                body = renderer.render() + limiter.prometheus().encode() + self.plane.tracer.prometheus().encode()
                return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

        # With frontend processes, this process serves its HTTP app and gRPC services on Unix sockets
        # in a private folder: the frontends relay there what they do not serve themselves.
        fronted = s.frontend_processes > 0 and (s.allow_http or s.allow_grpc)
        if fronted:
            self._socket_dir = Path(scratch_folder("pier-frontends-"))
        paths = {"http": str(self._socket_dir / "http.sock"), "grpc": str(self._socket_dir / "grpc.sock")} \
            if self._socket_dir is not None else {}
        behind = f" ({s.frontend_processes} frontend processes)" if fronted else ""
        if s.allow_http:
            app = build_app(self.plane, self.control, s.http_max_input_size,
                            restrictions.parse(s.http_restricted_api, "--http-restricted-api"), metrics,
                            s.http_header_forward_pattern, (keys, limiter), self.status)
            self._status_task = asyncio.ensure_future(self.status.history.run())
            if fronted:
                await self._serve_unix(app, paths["http"])
            else:
                self._listeners.append(await self._serve_http(app, s.http_address, s.http_port, s.reuse_http_port))
        if s.allow_grpc:
            address = f"unix:{paths['grpc']}" if fronted else f"{_host(s.grpc_address)}:{s.grpc_port}"
            try:
                # the client-facing options (keepalive, pings) are the frontends'; not for the Unix socket
                self._grpc = await start_grpc_server(self.plane, self.control, address, s.grpc_max_message_size,
                                                     () if fronted else s.grpc_options,
                                                     s.reuse_grpc_port and not fronted,
                                                     None if fronted else s.grpc_ssl,
                                                     restrictions.parse(s.grpc_restricted_protocol,
                                                                        "--grpc-restricted-protocol"),
                                                     s.grpc_header_forward_pattern, keys, limiter)
            except RuntimeError as exc:
                raise OSError(f"cannot bind gRPC to {address}: {exc}") from exc
        if fronted:
            self._frontends = FrontendPool(s, self.plane, limiter, paths)
            await self._frontends.start()
        if s.allow_http:
            log.info("Started HTTPService at %s:%d%s", s.http_address, s.http_port, behind)
        if s.allow_grpc:
            log.info("Started GRPCInferenceService at %s:%d%s%s", _host(s.grpc_address), s.grpc_port,
                     " (TLS)" if s.grpc_ssl else "", behind)
        if metrics is not None:
            app = web.Application()
            app.router.add_get("/metrics", metrics)
            await self._serve_http(app, s.metrics_address, s.metrics_port)
            log.info("Started Metrics Service at %s:%d", s.metrics_address, s.metrics_port)

    async def _serve_http(self, app: web.Application, address: str, port: int, reuse_port: bool = False) -> web.TCPSite:
        # handler_cancellation: a client that disconnects cancels its request (queued, or running
        # in the LLM engine), as gRPC does; load/unload run to completion regardless (control_plane).
        runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await runner.setup()
        site_type = fastpath.InferSite if fastpath.FAST_INFER in app else web.TCPSite
        site = site_type(runner, address, port, reuse_address=True, reuse_port=reuse_port or None)
        await site.start()
        self._runners.append(runner)
        return site

    async def _serve_unix(self, app: web.Application, path: str) -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await runner.setup()
        await web.UnixSite(runner, path).start()
        self._runners.append(runner)

    async def load_models(self) -> list[str]:
        s = self.settings
        if s.model_control_mode == "explicit" and "*" not in s.load_models:
            errors = await self.manager.load_all(list(s.load_models))
        else:
            errors = await self.manager.load_all()
        log.info("\n%s", _table(self.lifecycle.status_table()))
        if s.serve_path is not None:
            self._log_served_config(single_model.classify(s.serve_path, s.served_model_name))
        return errors

    def _log_served_config(self, served: single_model.ServedPath) -> None:
        """`pier serve PATH`: the config its model got, completed as auto-complete completes any."""
        try:
            config = self.plane.model_config_json(served.name, "")
        except PierError:
            return  # it did not load: the table above says why
        log.info("serving %s as '%s'; its configuration, completed: %s", served.path, served.name,
                 json.dumps(config))

    def start_watching(self) -> None:
        if self.settings.model_control_mode == "poll":
            s = self.settings
            self._watcher = RepositoryWatcher(self.manager, list(s.model_repositories), s.repository_poll_secs)
            self._watcher.start()

    async def shutdown(self) -> None:
        """Drain, then stop. New connections are refused from the start (the listeners close, as
        nginx, Go's Shutdown and Envoy do: in Kubernetes the preStop sleep has already let the
        endpoints forget this pod); a connection opened before is still served, over HTTP each
        answer with `Connection: close`, and gRPC clients get GOAWAY (their streams finish, their
        next call reconnects elsewhere). Once nothing is in flight the endpoints stop and the
        models unload. Bounded by ExitDeadline, not here."""
        self.phase = "draining"
        self.plane.begin_exit()
        if self._frontends is not None:
            self._frontends.begin_exit()  # they close their listeners and say Connection: close
        for site in self._listeners:
            await site.stop()  # the listening socket only: open connections stay
        if self._grpc is not None and self._frontends is None:  # stop accepting, GOAWAY; calls go on
            self._grpc_closing = asyncio.ensure_future(self._grpc.stop(self.settings.exit_timeout_secs))
        if self._watcher is not None:
            await self._watcher.stop()
        if self._status_task is not None:
            self._status_task.cancel()
        await self.plane.wait_idle()
        self.phase = "stopping the endpoints"
        if self._frontends is not None:
            await self._frontends.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
            if self._grpc_closing is not None:
                await self._grpc_closing
        for runner in self._runners:
            await runner.cleanup()
        if self._socket_dir is not None:
            drop_scratch(str(self._socket_dir))
        self.plane.shared_memory.close()
        self.plane.tracer.close()
        self.phase = "unloading the models"
        await self.manager.unload_all()

    def still_running(self) -> str:
        """What holds the shutdown up, in words (any thread): the requests in flight, else the phase."""
        running = self.plane.running()
        if running:
            return f"{len(running)} request{'s' if len(running) > 1 else ''} still running: " + "; ".join(running)
        serving = self._frontends.still_serving() if self._frontends is not None else []
        if serving and self.phase == "stopping the endpoints":
            return f"still stopping the endpoints: {', '.join(serving)} still writing to open connections"
        return f"still {self.phase}"


class ExitDeadline:
    """--exit-timeout-secs, armed when the drain begins. If the server has not stopped by then,
    a thread of its own (the event loop may be the one that is stuck: an LLM step, a model's
    execute on the loop) logs what still ran, kills every child process (pier.ipc: Python stubs,
    the LLM engine core, frontend processes) and exits with status 1, as Triton does ("Exit
    timeout expired. Exiting immediately."): a stuck execute or a stream left open cannot hold
    the exit, and no worker thread or executor is waited for."""

    def __init__(self, seconds: float, what: Callable[[], str]) -> None:
        self.seconds = seconds
        self._what = what
        self._lock = threading.Lock()
        self._done = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def arm(self) -> None:
        self._timer.start()

    def disarm(self) -> None:
        """The shutdown finished in time (once the deadline fired, this never returns: the process exits)."""
        with self._lock:
            self._done = True
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            try:
                what = self._what()
            except Exception as exc:  # never let the description keep the process alive
                what = f"(could not say what: {exc!r})"
            children = child_processes()
            killing = f"killing {len(children)} child process{'es' if len(children) > 1 else ''} " \
                f"({', '.join(children)}) and " if children else ""
            log.error("exit timeout: %g s after the signal, %s; %sexiting now with status 1", self.seconds, what,
                      killing)
            logging.disable(logging.CRITICAL)  # the supervisors would report each death, and restarts that fail
            try:
                kill_all()  # and the children's scratch folders (the frontends' sockets, the LLM core's)
            finally:
                logging.shutdown()  # flush the log handlers: os._exit skips them
                sys.stdout.flush()
                os._exit(1)


async def serve(settings: Settings) -> int:
    server = PierServer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start_endpoints()
    except OSError as exc:
        log.error("failed to start: %s", exc)
        await server.shutdown()
        return 1
    errors = await server.load_models()
    if errors and settings.exit_on_error:
        for e in errors:
            log.error("%s", e)
        log.error("exiting: a model failed to load and --exit-on-error is true")
        await server.shutdown()
        return 1
    for e in errors:
        log.warning("%s", e)
    server.plane.mark_started()
    server.start_watching()
    log.info("Pier is ready")
    await stop.wait()
    log.info("shutting down: new connections refused, finishing in-flight requests (at most %g s)",
             settings.exit_timeout_secs)
    deadline = ExitDeadline(settings.exit_timeout_secs, server.still_running)
    deadline.arm()
    try:
        await server.shutdown()
    finally:  # also when the shutdown fails (a child killed at the deadline can make it raise): once
        deadline.disarm()  # the deadline fired this waits for its os._exit, so its cleanup is not cut short
    log.info("stopped")
    return 0


def run(settings: Settings) -> int:
    log_settings.install(log_settings.LogSettings(
        log_file=settings.log_file, log_info=settings.log_info, log_warning=settings.log_warning,
        log_error=settings.log_error, log_verbose_level=settings.log_verbose, log_format=settings.log_format))
    quiet_client_mistakes()
    if settings.ignored_flags:
        log.warning("accepted for tritonserver compatibility, with no effect in Pier: %s",
                    ", ".join(settings.ignored_flags))
    if settings.backend_config_ignored:
        log.warning("--backend-config settings accepted with no effect in Pier: %s",
                    ", ".join(settings.backend_config_ignored))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if settings.serve_path is None:
        return asyncio.run(serve(settings))
    with single_model.repository(single_model.classify(settings.serve_path, settings.served_model_name)) as repo:
        return asyncio.run(serve(dataclasses.replace(settings, model_repositories=(*settings.model_repositories,
                                                                                    repo))))
