"""A Python model instance in its own process (the default; Triton's stub process): the server
side. `ProcessInstance` is the ModelInstance the scheduler sees; the model runs in a child
(`python -m pier.backends.python.stub`, backends/python/stub.py) that one supervisor thread per
instance starts, watches and restarts.

- Channels (server/ipc/channel.py): two SOCK_SEQPACKET socketpairs the child inherits. `exec`
  carries init / exec / finalize and their answers: the scheduler's worker thread sends a batch
  and reads its result itself (one execute at a time per instance, no thread hop). `aux`
  carries what crosses while a model runs (responses sent through response senders, BLS
  requests, model control, cancellation checks, logs, custom-metrics queries), read by the
  supervisor thread. Tensors over 64 KiB per message travel in shared memory with no name (a
  reusable memfd region per direction for the batches and results, a memfd per message on aux):
  no /dev/shm entries, nothing a crash can leave behind.
- Death: the supervisor polls the child's pidfd with the aux channel, so a child that exits,
  is killed (SIGKILL, OOM killer) or segfaults is seen at once. Its in-flight execute fails with
  "Stub process for model 'm' instance 'm_0' died: killed by signal 9 (SIGKILL)" (or "exited
  with code 3", "killed by signal 11 (SIGSEGV)"), so do the decoupled requests still streaming;
  `ModelContext.report_health(instance, reason)` tells the server, which marks the version
  UNAVAILABLE when every instance is down. Requests reaching a down instance fail at once with
  "Stub process '<instance>' is not healthy: <reason>".
- Restarts: a dead child is replaced (initialize() runs again) after 0, 1, 2, 4, 8, ... s
  (at most 30 s); a successful restart reports None (READY again). At most `restart_limit`
  (default 5) restarts in `restart_window_s` (default 600 s): one more death leaves the instance
  down until the model is loaded again. Both are `--backend-config=python,...` settings.
- Shutdown: close() asks the child to finalize, waits up to 30 s for it to exit, then kills it.
  The child dies with the server too (PR_SET_PDEATHSIG, end-of-file on its channels), so no
  stub outlives it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pier.contract.backend import InstanceContext, ModelContext, ModelInstance
from pier.contract.errors import PierError, internal, unavailable
from pier.contract.types import ExecuteResult, InferenceRequest
from pier.ipc import channel as wire
from pier.ipc.processes import exit_cause

log = logging.getLogger("pier.backends.python")

FINALIZE_TIMEOUT_S = 30.0
METRICS_TIMEOUT_S = 0.25  # a scrape waits this long for a busy stub's custom metrics, then shows the last ones
_MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Launch:
    """How to start a stub: the command before the stub's own arguments, and its environment."""

    argv: tuple[str, ...]
    env: dict[str, str] | None = None


def default_launch() -> Launch:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # a model's print() reaches the server's log as it happens
    return Launch((sys.executable, "-m", "pier.backends.python.stub"), env)


@dataclass(eq=False)
class _Child:
    """One stub process (a restart makes a new one)."""

    proc: subprocess.Popen[bytes]
    pidfd: int
    exec_sock: socket.socket
    aux_sock: socket.socket
    exec_rx: wire.Receiver
    aux_rx: wire.Receiver
    alive: bool = True
    reason: str = ""
    dead: threading.Event = field(default_factory=threading.Event)
    busy: bool = False  # a worker thread is using exec_sock
    has_metrics: bool = False
    arena: wire.Arena = field(default_factory=wire.Arena)  # the batches' large tensors
    calls: dict[int, Any] = field(default_factory=dict)  # metrics queries waiting for the child
    bls: set[Any] = field(default_factory=set)  # BLS calls running for it on the server's loop


class _Entry:
    """A request the child holds: in an execute, or a decoupled one still sending."""

    __slots__ = ("request", "child", "executing", "final")

    def __init__(self, request: InferenceRequest, child: _Child) -> None:
        self.request, self.child, self.executing, self.final = request, child, True, False


class ProcessInstance(ModelInstance):
    may_run_on_event_loop = False  # execute blocks on the child
    unbatched = True  # Triton hands execute() the list of requests, never a merged batch

    def __init__(self, ctx: ModelContext, where: InstanceContext, launch: Launch, restart_limit: int = 5,
                 restart_window_s: float = 600.0) -> None:
        self._ctx = ctx
        self._where = where
        self._launch = launch
        self._model = ctx.spec.name
        self._name = where.name
        self._restart_limit = restart_limit
        self._restart_window_s = restart_window_s
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._down = ""  # why the instance cannot serve now ("" while it can)
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._restarts: collections.deque[float] = collections.deque()
        self._closing = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._started = threading.Event()
        self._start_error: PierError | None = None
        self._metrics_text = ""
        # The supervisor starts every child: PR_SET_PDEATHSIG follows the thread that forked the
        # child, so that thread must live as long as the instance.
        self._thread = threading.Thread(target=self._supervise, name=f"pier-stub-{where.name}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            self._close_fds()
            raise self._start_error

    # ---- the scheduler's side ------------------------------------------------------------------

    def _unhealthy(self) -> str:
        return f"Stub process '{self._name}' is not healthy: {self._down or 'it is starting'}"

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        n = len(requests)
        with self._lock:
            child = self._child
            if child is None or not child.alive:
                return [unavailable(self._unhealthy())] * n
            rids = [next(self._ids) for _ in requests]
            for rid, r in zip(rids, requests):
                self._entries[rid] = _Entry(r, child)
            child.busy = True
        try:
            got: tuple[list[Any], wire.Source] | None = None
            try:
                packer = wire.Packer()
                batch = [wire.request_out(r, packer, rid) for rid, r in zip(rids, requests)]
            except Exception as exc:
                self._settle(child, rids, requests, failed=True)
                return [internal(f"cannot pass the request to python model '{self._model}': {exc}")] * n
            try:
                wire.send(child.exec_sock, ["exec", 0, batch], packer, arena=child.arena)
                got = child.exec_rx.recv()
            except OSError:
                got = None
            if got is None:  # the child died (the supervisor shut this channel down)
                child.dead.wait(10)
                self._settle(child, rids, requests, failed=True)
                return [internal(child.reason or f"Stub process for model '{self._model}' instance "
                                 f"'{self._name}' died")] * n
            msg, mapping = got
            child.has_metrics = bool(msg[3])
            try:
                results: list[ExecuteResult] = [wire.result_in(w, mapping) or internal("no result")
                                                for w in msg[2]]
            except Exception as exc:
                results = [internal(f"python model '{self._model}' returned an unusable result: {exc}")] * n
            self._settle(child, rids, requests, failed=False)
            return results
        finally:
            with self._lock:
                child.busy = False
                if not child.alive:
                    child.exec_sock.close()

    def _settle(self, child: _Child, rids: list[int], requests: Sequence[InferenceRequest], failed: bool) -> None:
        """An execute ended: forget its requests, except decoupled ones still sending (whose child
        died meanwhile: they end here, as the supervisor only ends those not executing)."""
        orphans = []
        with self._lock:
            for rid in rids:
                entry = self._entries.get(rid)
                if entry is None:
                    continue
                if failed or entry.final or entry.request.response_sink is None:
                    del self._entries[rid]
                elif not child.alive:
                    del self._entries[rid]
                    orphans.append(entry.request)
                else:
                    entry.executing = False
        for r in orphans:
            _end_stream(r, internal(child.reason))

    def prometheus(self, model: str, version: str) -> str:
        """The model's custom metric families, asked of the child (they live there; they go with it)."""
        child = self._child
        if child is None or not child.alive or not child.has_metrics:
            return ""
        box: list[str] = []
        done = threading.Event()
        qid = next(self._ids)

        def answered(text: str) -> None:
            box.append(text)
            done.set()

        child.calls[qid] = answered
        try:
            wire.send(child.aux_sock, ["metrics?", qid], flags=socket.MSG_DONTWAIT)
            if done.wait(METRICS_TIMEOUT_S):
                self._metrics_text = box[0]
        except OSError:
            pass
        finally:
            child.calls.pop(qid, None)
        return self._metrics_text

    def close(self) -> None:
        self._closing.set()
        os.write(self._wake_w, b"x")
        self._thread.join(FINALIZE_TIMEOUT_S + 10)
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- the supervisor thread --------------------------------------------------------------

    def _supervise(self) -> None:
        first = True
        while True:
            child, error = self._start_child()
            if child is not None and error is None:
                with self._lock:
                    self._child, self._down = child, ""
                if first:
                    first = False
                    self._started.set()
                else:
                    log.info("Stub process for model '%s' instance '%s' restarted", self._model, self._name)
                    self._ctx.report_health(self._name, None)
                if self._serve(child) == "closing":
                    self._finalize(child)
                    return
                reason = self._died(child)
            elif self._closing.is_set():
                if child is not None:
                    self._kill(child)
                self._started.set()
                return
            else:
                assert error is not None
                if child is not None:
                    self._kill(child)
                if first:
                    self._start_error = error
                    self._started.set()
                    return
                reason = f"Stub process for model '{self._model}' instance '{self._name}' could not be restarted: " \
                         f"{error.message}"
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self._restart_window_s:
                self._restarts.popleft()
            if len(self._restarts) >= self._restart_limit:
                reason += (f"; not restarted: {len(self._restarts)} restarts in the last {self._restart_window_s:g} s "
                           "(load the model again to restart it)")
                with self._lock:
                    self._down = reason
                log.error("%s", reason)
                self._ctx.report_health(self._name, reason)
                self._closing.wait()
                self._started.set()
                return
            delay = 0.0 if not self._restarts else min(2.0 ** (len(self._restarts) - 1), _MAX_BACKOFF_S)
            with self._lock:
                self._down = f"{reason}; restarting" + (f" in {delay:g} s" if delay else "")
            log.error("%s", self._down)
            self._ctx.report_health(self._name, reason)
            self._restarts.append(now)
            if self._closing.wait(delay):
                return

    def _start_child(self) -> tuple[_Child | None, PierError | None]:
        """Start a stub and run initialize() in it: (child, None) when it is ready."""
        exec_parent, exec_child = wire.channel_pair()
        aux_parent, aux_child = wire.channel_pair()
        fds = (exec_child.fileno(), aux_child.fileno())
        argv = [*self._launch.argv, "--exec-fd", str(fds[0]), "--aux-fd", str(fds[1]),
                "--parent-pid", str(os.getpid()), "--model", self._model, "--instance", self._name]
        try:
            proc = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, env=self._launch.env)
        except OSError as exc:
            for s in (exec_parent, exec_child, aux_parent, aux_child):
                s.close()
            return None, unavailable(f"cannot start the stub process for model '{self._model}': {exc}")
        finally:
            exec_child.close()
            aux_child.close()
        child = _Child(proc, os.pidfd_open(proc.pid), exec_parent, aux_parent, wire.Receiver(exec_parent),
                       wire.Receiver(aux_parent))
        ctx, where = self._ctx, self._where
        init = {"spec": ctx.spec, "version": ctx.version, "model_dir": ctx.model_dir, "version_dir": ctx.version_dir,
                "config_json": ctx.config_json, "instance": (where.name, where.kind, where.device_id),
                "log_level": logging.getLogger("pier.python_model").getEffectiveLevel()}
        try:
            wire.send(exec_parent, ["init", pickle.dumps(init)])
        except OSError:
            pass
        poller = select.poll()
        for fd in (exec_parent.fileno(), aux_parent.fileno(), child.pidfd, self._wake_r):
            poller.register(fd, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    return child, unavailable("the model is being unloaded")
                if fd == aux_parent.fileno():
                    if not self._read_aux(child):
                        poller.unregister(fd)
                    continue
                if fd == exec_parent.fileno():
                    try:
                        got = child.exec_rx.recv()
                    except OSError:
                        got = None
                    if got is None:
                        poller.unregister(fd)
                        continue
                    msg = got[0]
                    if msg[0] == "ready":
                        child.has_metrics = bool(msg[1])
                        return child, None
                    return child, wire.error_in(msg[1:])
                if fd == child.pidfd:
                    self._drain_aux(child)
                    child.alive = False
                    return child, unavailable(f"Stub process for model '{self._model}' instance '{self._name}' died "
                                              f"during initialize(): {exit_cause(child.proc.wait())}")

    def _serve(self, child: _Child) -> str:
        """Handle the child's aux messages until it dies ("died") or the model unloads ("closing")."""
        poller = select.poll()
        for fd in (child.aux_sock.fileno(), child.pidfd, self._wake_r):
            poller.register(fd, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    return "closing"
                if fd == child.pidfd:
                    return "died"
                if not self._read_aux(child):
                    poller.unregister(fd)

    def _drain_aux(self, child: _Child) -> None:
        """What the child sent before it died still counts (a response it sent, a log line)."""
        while True:
            try:
                got = child.aux_rx.recv(socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError):
                return
            if got is None:
                return
            self._handle(child, *got)

    def _read_aux(self, child: _Child) -> bool:
        try:
            got = child.aux_rx.recv()
        except OSError:
            got = None
        if got is None:
            return False
        try:
            self._handle(child, *got)
        except Exception:  # a message this side cannot handle must not stop the supervisor
            log.exception("python model '%s': unusable message from its stub process", self._model)
        return True

    def _died(self, child: _Child) -> str:
        self._drain_aux(child)
        rc = child.proc.wait()
        os.close(child.pidfd)
        child.pidfd = -1
        reason = f"Stub process for model '{self._model}' instance '{self._name}' died: {exit_cause(rc)}"
        with self._lock:
            child.alive, child.reason = False, reason
            self._child = None
            self._down = reason
            self._metrics_text = ""  # the model's custom metrics went with the process
            ended = [rid for rid, e in self._entries.items() if e.child is child and not e.executing]
            streams = [self._entries.pop(rid).request for rid in ended]
            busy = child.busy
        try:  # wakes the worker thread waiting for the child's answer
            child.exec_sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not busy:
            child.exec_sock.close()
        child.aux_sock.close()
        child.dead.set()
        for fut in list(child.bls):
            fut.cancel()
        for r in streams:
            _end_stream(r, internal(reason))
        return reason

    def _finalize(self, child: _Child) -> None:
        """The model unloads: finalize() in the child, which then exits (killed if it does not)."""
        try:
            wire.send(child.exec_sock, ["finalize"])
        except OSError:
            pass
        deadline = time.monotonic() + FINALIZE_TIMEOUT_S
        poller = select.poll()
        poller.register(child.aux_sock.fileno(), select.POLLIN)
        poller.register(child.pidfd, select.POLLIN)
        exited = False
        while not exited:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("Stub process for model '%s' instance '%s' did not exit %g s after finalize: killed",
                            self._model, self._name, FINALIZE_TIMEOUT_S)
                break
            for fd, _ in poller.poll(left * 1000):
                if fd == child.pidfd:
                    exited = True
                elif not self._read_aux(child):
                    poller.unregister(fd)
        self._kill(child)
        with self._lock:
            child.alive, child.reason = False, f"model '{self._model}' was unloaded"
            self._child = None
            self._down = child.reason
            streams = [e.request for e in self._entries.values()]
            self._entries.clear()
        for r in streams:
            _end_stream(r, unavailable(child.reason))

    def _kill(self, child: _Child) -> None:
        """Make sure `child` is gone and reaped, and release what it held (idempotent)."""
        if child.proc.poll() is None:
            try:
                child.proc.kill()
            except OSError:
                pass
        child.proc.wait()
        for s in (child.exec_sock, child.aux_sock):
            s.close()
        if child.pidfd >= 0:
            os.close(child.pidfd)
            child.pidfd = -1

    # ---- the child's aux messages ------------------------------------------------------------

    def _reply(self, child: _Child, message: list[Any], packer: wire.Packer | None = None) -> None:
        try:
            wire.send(child.aux_sock, message, packer)
        except OSError:  # the child is gone: the supervisor sees it on its pidfd
            pass

    def _handle(self, child: _Child, msg: list[Any], mapping: wire.Source) -> None:
        kind = msg[0]
        if kind == "send":
            _, rid, w, final = msg
            entry = self._entries.get(rid)
            if entry is None or entry.request.response_sink is None:
                return
            if final:
                with self._lock:
                    entry.final = True
                    if not entry.executing:
                        self._entries.pop(rid, None)
            entry.request.response_sink(wire.result_in(w, mapping), final)
        elif kind == "cancelled?":
            entry = self._entries.get(msg[2])
            self._reply(child, ["cancelled", msg[1], bool(entry is not None and entry.request.cancelled)])
        elif kind == "log":
            logging.getLogger(msg[2]).log(msg[1], "%s", msg[3])
        elif kind == "bls":
            self._bls(child, msg[1], msg[2], msg[3], mapping)
        elif kind == "mgmt":
            threading.Thread(target=self._manage, args=(child, *msg[1:]), daemon=True,
                             name=f"pier-stub-{self._name}-mgmt").start()
        elif kind == "metrics":
            waiter = child.calls.get(msg[1])
            if waiter is not None:
                waiter(msg[2])

    def _bls(self, child: _Child, qid: int, decoupled: bool, w: list[Any], mapping: wire.Source) -> None:
        services = self._ctx.services
        if services is None:
            error = wire.error_out(internal("BLS requests can only be executed inside a running server"))
            if decoupled:
                self._reply(child, ["bls_item", qid, error])
                self._reply(child, ["bls_end", qid])
            else:
                self._reply(child, ["bls_reply", qid, error])
            return
        _, request, _ = wire.request_in(w, mapping)

        def send(kind: str, item: Any) -> None:
            packer = wire.Packer()
            try:
                out = wire.response_out(item, packer)
            except Exception as exc:
                packer, out = wire.Packer(), wire.error_out(internal(f"cannot pass the BLS response on: {exc}"))
            self._reply(child, [kind, qid, out], packer)

        async def run() -> None:
            if decoupled:
                try:
                    async for item in services.infer_stream_async(request):
                        send("bls_item", item)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    send("bls_item", exc if isinstance(exc, PierError) else internal(str(exc)))
                self._reply(child, ["bls_end", qid])
                return
            answer: Any
            try:
                answer = await services.infer_async(request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # errors come back in the response, as in Triton
                answer = exc
            send("bls_reply", answer)

        fut = asyncio.run_coroutine_threadsafe(run(), services.event_loop)
        child.bls.add(fut)
        fut.add_done_callback(child.bls.discard)

    def _manage(self, child: _Child, qid: int, op: str, name: str, arg: Any) -> None:
        services = self._ctx.services
        try:
            if services is None:
                raise internal("model control is only available inside a running server")
            value: Any = None
            if op == "load":
                services.load_model(name, arg)
            elif op == "unload":
                services.unload_model(name, arg)
            else:
                value = services.model_ready(name, arg)
            self._reply(child, ["mgmt_reply", qid, False, value])
        except PierError as exc:
            self._reply(child, ["mgmt_reply", qid, True, wire.error_out(exc)])
        except Exception as exc:
            self._reply(child, ["mgmt_reply", qid, True, wire.error_out(internal(str(exc)))])


def _end_stream(request: InferenceRequest, error: PierError) -> None:
    sink = request.response_sink
    if sink is None:
        return
    try:
        sink(error, True)
    except Exception:  # the stream is already over
        pass
