"""The server's side of `--frontend-processes N`: N frontend processes (worker.py), each run by a
pier.ipc AsyncSupervisor (started, watched through its pidfd on the loop, restarted when it dies:
its clients' connections drop, the other frontends keep serving; at most 10 restarts a minute,
the first at once, then after 1, 2, 4, ... s). The pool serves the inference requests they
decode through the one DataPlane (so a model's dynamic batcher still sees every request in one
queue), answers their rate-limit questions, and tells them when the server drains and when to
stop. What it keeps of each: its channel and the requests in flight, failed when it dies."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceResponse
from pier.dataplane.plane import DataPlane
from pier.frontends.guards import RateLimiter
from pier.frontends.workers import channel as ch
from pier.frontends.workers import messages as fm
from pier.ipc import channel as wire
from pier.ipc.async_supervisor import AsyncSupervisor
from pier.ipc.child import Child, ChildExited, Exit, Launch, RestartPolicy, StartTimeout
from pier.ipc.messages import BadMessage
from pier.observability import log_settings
from pier.settings import Settings

log = logging.getLogger("pier.frontends")

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
RESTARTS, RESTART_WINDOW_S = 10, 60.0  # a frontend that dies more often than this stays down
RESTART_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0


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
    """One frontend process's channel and the requests it has in flight (pier.ipc's Link)."""

    index: int
    channel: ch.Channel | None = None
    child: Child[_Frontend] | None = None
    tasks: dict[int, asyncio.Future[Any]] = field(default_factory=dict)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


class _Slot:
    """Frontend process `index`, as its supervisor's owner (pier.ipc.async_supervisor.AsyncChildOwner)."""

    def __init__(self, pool: FrontendPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.supervisor = AsyncSupervisor(self, RestartPolicy(RESTARTS, RESTART_WINDOW_S, RESTART_BACKOFF_S,
                                                              MAX_BACKOFF_S),
                                          f"frontend process {index}", START_TIMEOUT_S, STOP_TIMEOUT_S)

    async def start(self) -> None:
        try:
            await self.supervisor.start()
        except StartTimeout:
            raise OSError(f"frontend process {self.index} did not start within {START_TIMEOUT_S:.0f} s") from None
        except ChildExited:
            raise OSError(f"frontend process {self.index} exited while starting") from None

    def launch(self) -> tuple[Launch, _Frontend]:
        pool = self.pool
        ours, theirs = wire.channel_pair()
        frontend = _Frontend(self.index)
        frontend.channel = ch.Channel(ours, lambda m, s: pool._message(frontend, m, s), lambda: pool._closed(frontend),
                                      fm.FROM_FRONTEND, lambda exc: pool._bad(frontend, exc))
        argv = [sys.executable, "-m", "pier.frontends.workers.worker", str(theirs.fileno()), str(self.index)]
        return Launch(argv, inherit=(theirs,)), frontend

    def started(self, child: Child[_Frontend]) -> None:
        frontend = child.link
        frontend.child = child
        assert frontend.channel is not None
        frontend.channel.send(fm.Start(self.pool.settings, self.pool._paths))
        frontend.channel.send(fm.LogSettings(log_settings.current().as_dict()))  # as changed since startup
        if self.pool._exiting:
            frontend.channel.send(fm.Exiting())

    def serving(self, child: Child[_Frontend]) -> None:
        self.pool._frontends[self.index] = child.link

    def drain(self, child: Child[_Frontend]) -> None:
        if child.link.channel is not None:
            child.link.channel.drain()

    def restarted(self, child: Child[_Frontend]) -> None:
        pass  # said when it died ("restarting it")

    def lost(self, child: Child[_Frontend] | None, end: Exit) -> None:
        if child is not None:
            self.pool._frontends.pop(self.index, None)
            self.pool._closed(child.link)
            what = f"frontend process {self.index} (pid {child.pid}) {end.cause}"
        else:
            what = f"frontend process {self.index} could not restart: {end.error}"
        if end.restart_in is None:
            log.error("%s; it died %d times in %.0f s: not restarting it", what, end.restarts + 1, end.policy.window_s)
        else:
            log.warning("%s: restarting it%s", what, f" in {end.restart_in:g} s" if end.restart_in else "")

    def ask_to_stop(self, child: Child[_Frontend]) -> None:
        if child.link.channel is not None:
            child.link.channel.send(fm.Stop())

    def stopped(self, child: Child[_Frontend] | None, killed: bool) -> None:
        if child is not None and killed:
            log.warning("frontend process %d (pid %d) did not stop: killing it", self.index, child.pid)
        if child is not None:
            self.pool._frontends.pop(self.index, None)
            self.pool._closed(child.link)


class FrontendPool:
    def __init__(self, settings: Settings, plane: DataPlane, limiter: RateLimiter, paths: dict[str, str]) -> None:
        self.settings = settings
        self.count = settings.frontend_processes
        self._plane = plane
        self._limiter = limiter
        self._paths = paths
        self._slots = [_Slot(self, i) for i in range(self.count)]
        self._frontends: dict[int, _Frontend] = {}  # those serving now, by index
        self._exiting = False
        log_settings.on_change(lambda doc: self._broadcast(fm.LogSettings(doc)))

    def _broadcast(self, message: fm.ToFrontend) -> None:
        for f in self._frontends.values():
            if f.channel is not None:
                f.channel.send(message)

    @property
    def pids(self) -> list[int]:
        return [f.child.pid for f in self._frontends.values() if f.child is not None]

    async def start(self) -> None:
        """Start every frontend; raises OSError with the first one's reason when any cannot start
        (bind), once every start has ended (those that started are stopped by stop())."""
        check_ports_free(self.settings)
        outcomes = await asyncio.gather(*(slot.start() for slot in self._slots), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

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
            if frontend.child is not None:
                frontend.child.ready()
        elif isinstance(message, fm.Failed):
            if frontend.child is not None:
                frontend.child.refuse(OSError(message.message))

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

    @staticmethod
    def _closed(frontend: _Frontend) -> None:
        """Its channel closed or it is gone: what it had in flight has no one to answer to."""
        for task in frontend.tasks.values():
            task.cancel()
        frontend.tasks.clear()

    # ---- drain and stop -------------------------------------------------------------------

    def begin_exit(self) -> None:
        """The server drains: the frontends close their listeners (new connections are refused;
        gRPC clients get GOAWAY), and every answer from now on says `Connection: close`."""
        self._exiting = True
        self._broadcast(fm.Exiting())

    def still_serving(self) -> list[str]:
        """The frontend processes not stopped yet, by name (any thread: a snapshot of a dict). When
        the drain waits on them, what they hold is a client's connection the server is still writing
        to: the requests relayed to the plane have all ended."""
        return [f"frontend process {index}" for index in sorted(list(self._frontends))]

    async def stop(self) -> None:
        """Tell every frontend to stop (each finishes what it has open) and wait for all of them;
        one still running after STOP_TIMEOUT_S is killed."""
        await asyncio.gather(*(slot.supervisor.stop() for slot in self._slots))
        self._frontends.clear()
