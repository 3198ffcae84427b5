"""The server's side of `--frontend-processes N`: starts N frontend processes (worker.py), serves
the inference requests they decode through the one DataPlane (so a model's dynamic batcher still
sees every request in one queue), tells them when the server drains and when to stop, and
restarts one that dies (its clients' connections drop; the other frontends keep serving)."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceResponse
from pier.dataplane.plane import DataPlane
from pier.frontends.guards import RateLimiter
from pier.frontends.workers import channel as ch
from pier.frontends.workers import messages as fm
from pier.ipc import channel as wire
from pier.ipc.messages import BadMessage
from pier.ipc.processes import exit_cause
from pier.observability import log_settings
from pier.settings import Settings

log = logging.getLogger("pier.frontends")

START_TIMEOUT_S = 60.0
RESTARTS, RESTART_WINDOW_S = 10, 60.0  # a frontend that dies more often than this stays down


def check_ports_free(settings: Settings) -> None:
    """Raise OSError when the HTTP or gRPC port is taken. The frontends bind with SO_REUSEPORT, so
    a port that another process of this user holds the same way (a second `pier serve
    --frontend-processes` on it, say) would bind again and the kernel would split the clients
    between the two servers; a probe without SO_REUSEPORT refuses it as one process would. Not
    with --reuse-http-port / --reuse-grpc-port: sharing the port is asked for then."""
    ports = []
    if settings.allow_http and not settings.reuse_http_port:
        ports.append(("HTTP", settings.http_address, settings.http_port))
    if settings.allow_grpc and not settings.reuse_grpc_port:
        ports.append(("gRPC", settings.grpc_address, settings.grpc_port))
    for what, address, port in ports:
        family, kind, proto, _, where = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the frontends bind: TIME_WAIT is free
            if family == socket.AF_INET6 and what == "HTTP":  # asyncio binds IPv6 only there, as one process does
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot bind {what} to {address}:{port}: {exc.strerror}") from None


def _same(response: InferenceResponse) -> InferenceResponse:
    return response


@dataclass(eq=False)
class _Frontend:
    index: int
    proc: subprocess.Popen
    channel: ch.Channel | None = None
    started: asyncio.Future[None] | None = None
    tasks: dict[int, asyncio.Future[Any]] = field(default_factory=dict)


class FrontendPool:
    def __init__(self, settings: Settings, plane: DataPlane, limiter: RateLimiter, paths: dict[str, str]) -> None:
        self.settings = settings
        self.count = settings.frontend_processes
        self._plane = plane
        self._limiter = limiter
        self._paths = paths
        self._frontends: dict[int, _Frontend] = {}
        self._restarts: dict[int, list[float]] = {}
        self._stopping = False
        self._exiting = False
        log_settings.on_change(lambda doc: self._broadcast(fm.LogSettings(doc)))

    def _broadcast(self, message: fm.ToFrontend) -> None:
        for f in self._frontends.values():
            if f.channel is not None:
                f.channel.send(message)

    @property
    def pids(self) -> list[int]:
        return [f.proc.pid for f in self._frontends.values()]

    async def start(self) -> None:
        """Start every frontend; raises OSError with the first one's reason when any cannot bind."""
        check_ports_free(self.settings)
        await asyncio.gather(*(self._start(i) for i in range(self.count)))

    async def _start(self, index: int) -> None:
        ours, theirs = wire.channel_pair()
        try:
            proc = subprocess.Popen([sys.executable, "-m", "pier.frontends.workers.worker", str(theirs.fileno()),
                                     str(index)], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        loop = asyncio.get_running_loop()
        frontend = _Frontend(index, proc, started=loop.create_future())
        self._frontends[index] = frontend
        frontend.channel = ch.Channel(ours, lambda m, s: self._message(frontend, m, s),
                                      lambda: self._closed(frontend), fm.FROM_FRONTEND,
                                      lambda exc: self._bad(frontend, exc))
        frontend.channel.send(fm.Start(self.settings, self._paths))
        frontend.channel.send(fm.LogSettings(log_settings.current().as_dict()))  # as changed since startup
        if self._exiting:
            frontend.channel.send(fm.Exiting())
        assert frontend.started is not None
        try:
            await asyncio.wait_for(asyncio.shield(frontend.started), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            proc.kill()
            raise OSError(f"frontend process {index} did not start within {START_TIMEOUT_S:.0f} s") from None

    # ---- messages -------------------------------------------------------------------------

    def _message(self, frontend: _Frontend, message: fm.FromFrontend, mapping: wire.Source) -> None:
        if isinstance(message, fm.Admit):  # at once, in arrival order: the buckets are the server's
            refused = self._limiter.admit(message.model, message.key) if self._limiter.enabled else None
            assert frontend.channel is not None
            frontend.channel.send(fm.Admitted(message.rid, refused))
        elif isinstance(message, fm.Refund):
            self._limiter.refund(message.model, message.key)
        elif isinstance(message, fm.Infer):
            frontend.tasks[message.rid] = asyncio.ensure_future(self._serve(frontend, message, mapping))
        elif isinstance(message, fm.Cancel):
            task = frontend.tasks.pop(message.rid, None)
            if task is not None:
                task.cancel()
        elif isinstance(message, fm.Ready):
            if frontend.started is not None and not frontend.started.done():
                frontend.started.set_result(None)
        elif isinstance(message, fm.Failed):
            if frontend.started is not None and not frontend.started.done():
                frontend.started.set_exception(OSError(message.message))

    def _bad(self, frontend: _Frontend, exc: BadMessage) -> None:
        """A message that does not decode: the request it names (its first field) gets the error as
        its answer, the rest goes on."""
        log.error("frontend process %d: %s", frontend.index, exc)
        if exc.kind not in ("Cancel", "Refund", "Ready", "Failed") and isinstance(exc.ref, int) \
                and frontend.channel is not None:
            frontend.channel.send(fm.Reply(exc.ref, wire.error_out(PierError(ErrorCode.INTERNAL, str(exc)))))

    async def _serve(self, frontend: _Frontend, message: fm.Infer, mapping: wire.Source) -> None:
        rid = message.rid
        packer: wire.Packer | None = None
        reply: fm.Reply
        try:
            try:
                request = wire.request_in(message.request, mapping)
                response = await self._plane.serve(request, _same, None, message.protocol, message.received_ns)
                packer = wire.Packer()
                reply = fm.Reply(rid, wire.response_out(response, packer))
            except asyncio.CancelledError:
                if rid not in frontend.tasks:  # CANCEL (its client went away) or the frontend is gone: no answer
                    raise
                # a backend's own cancellation of this request: the client gets an answer
                reply = fm.Reply(rid, wire.error_out(PierError(ErrorCode.INTERNAL, "the request was cancelled")))
            except PierError as exc:
                reply = fm.Reply(rid, wire.error_out(exc))
            except Exception as exc:
                reply = fm.Reply(rid, self._internal(frontend, exc))
            channel = frontend.channel
            if channel is not None:
                def failed(exc: BaseException) -> None:  # what the answer holds cannot travel: say so instead
                    channel.send(fm.Reply(rid, self._internal(frontend, exc)))

                try:
                    channel.send(reply, packer, failed)
                except Exception as exc:
                    failed(exc)
        finally:
            frontend.tasks.pop(rid, None)

    @staticmethod
    def _internal(frontend: _Frontend, exc: BaseException) -> wire.WireError:
        log.error("a request from frontend process %d failed", frontend.index, exc_info=exc)
        return wire.error_out(PierError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"))

    def _closed(self, frontend: _Frontend) -> None:
        for task in frontend.tasks.values():
            task.cancel()
        frontend.tasks.clear()
        if frontend.started is not None and not frontend.started.done():
            frontend.started.set_exception(OSError(f"frontend process {frontend.index} exited while starting"))
        if not self._stopping:
            asyncio.ensure_future(self._restart(frontend))

    async def _restart(self, frontend: _Frontend) -> None:
        code = await asyncio.get_running_loop().run_in_executor(None, frontend.proc.wait)
        if self._stopping or self._frontends.get(frontend.index) is not frontend:
            return
        now = time.monotonic()
        recent = [t for t in self._restarts.get(frontend.index, []) if now - t < RESTART_WINDOW_S] + [now]
        self._restarts[frontend.index] = recent
        if len(recent) > RESTARTS:
            log.error("frontend process %d (pid %d) %s; it died %d times in %.0f s: not restarting it",
                      frontend.index, frontend.proc.pid, exit_cause(code), len(recent), RESTART_WINDOW_S)
            del self._frontends[frontend.index]
            return
        log.warning("frontend process %d (pid %d) %s: restarting it", frontend.index, frontend.proc.pid,
                    exit_cause(code))
        try:
            await self._start(frontend.index)
        except OSError as exc:
            log.error("frontend process %d could not restart: %s", frontend.index, exc)

    # ---- drain and stop -------------------------------------------------------------------

    def begin_exit(self) -> None:
        """The server drains: every answer from now on says `Connection: close`."""
        self._exiting = True
        self._broadcast(fm.Exiting())

    async def stop(self, timeout: float = 30.0) -> None:
        """Tell every frontend to stop (each finishes what it has open) and wait for all of them;
        one still running after `timeout` is killed."""
        self._stopping = True
        self._broadcast(fm.Stop())
        await asyncio.gather(*(self._stop_one(f, timeout) for f in list(self._frontends.values())))
        self._frontends.clear()

    async def _stop_one(self, frontend: _Frontend, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, frontend.proc.wait), timeout)
        except asyncio.TimeoutError:
            log.warning("frontend process %d (pid %d) did not stop: killing it", frontend.index, frontend.proc.pid)
            frontend.proc.kill()
            await loop.run_in_executor(None, frontend.proc.wait)
        if frontend.channel is not None:
            frontend.channel.close()
