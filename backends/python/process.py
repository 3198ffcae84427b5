"""A Python model instance in its own process (the default; Triton's stub process): the server
side. `ProcessInstance` is the ModelInstance the scheduler sees; the model runs in a child
(`python -m pier.backends.python.stub`, backends/python/stub.py) that a pier.ipc Supervisor
starts, watches and restarts; this module is that supervisor's owner (its transport and what
a death fails), aux.py handles what the child asks of the server while its model runs.

- Channels (pier.ipc.channel, messages.py): two SOCK_SEQPACKET socketpairs the child inherits.
  `exec` carries init / exec / finalize and their answers: the scheduler's worker thread sends a
  batch and reads its result itself (one execute at a time per instance, no thread hop). `aux`
  carries what crosses while a model runs, read on the supervisor's thread. Tensors over 64 KiB
  per message travel in shared memory with no name (a reusable memfd region per direction for
  the batches and results, a memfd per message on aux): nothing a crash can leave behind.
- Death: seen at once (the supervisor's pidfd). Its in-flight execute fails with "Stub process
  for model 'm' instance 'm_0' died: killed by signal 9 (SIGKILL)" (or "exited with code 3",
  "killed by signal 11 (SIGSEGV)"), so do the decoupled requests still streaming;
  `ModelContext.report_health(instance, reason)` tells the server, which marks the version
  UNAVAILABLE when every instance is down. Requests reaching a down instance fail at once with
  "Stub process '<instance>' is not healthy: <reason>".
- Restarts (pier.ipc's budget): a dead child is replaced (initialize() runs again) at once, then
  after 1, 2, 4, ... s (at most 30 s); a successful restart reports None (READY again). At most
  `restart_limit` (default 5) restarts in `restart_window_s` (default 600 s): one more death
  leaves the instance down until the model is loaded again. Both are `--backend-config=python,...`
  settings.
- Unload and shutdown: close() waits until the decoupled requests still sending end (as Triton),
  then asks the child to finalize, waits up to 30 s for it to exit, then kills it.
  The child dies with the server too (pier.ipc.processes.die_with_parent), so no stub outlives it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pier.contract.backend import Finish, InstanceContext, ModelContext, ModelInstance
from pier.contract.errors import PierError, internal, unavailable
from pier.contract.types import ExecuteResult, InferenceRequest, Outputs
from pier.ipc import channel as wire
from pier.ipc.child import Child, ChildExited, Exit, Launch, RestartPolicy
from pier.ipc.messages import BadMessage
from pier.ipc.supervisor import Readers, Supervisor

from . import messages as m
from .aux import AuxHandler, Entry, StubLink, end_stream

log = logging.getLogger("pier.backends.python")

FINALIZE_TIMEOUT_S = 30.0
# The tensor bytes of a batch, or of its answer, that the event loop copies into / out of the exec
# channel's shared memory itself (~0.05 ms per MiB); a larger one is copied on a worker thread.
LOOP_COPY_BYTES = 1 << 20
SENDS_TIMEOUT_S = 10.0  # an execute's results wait at most this long for the responses sent before them
METRICS_TIMEOUT_S = 0.25  # a scrape waits this long for a busy stub's custom metrics, then shows the last ones
RESTART_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0


@dataclass(frozen=True)
class StubCommand:
    """How to start a stub: the command before the stub's own arguments, and its environment."""

    argv: tuple[str, ...]
    env: dict[str, str] | None = None


def default_launch() -> StubCommand:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # a model's print() reaches the server's log as it happens
    return StubCommand((sys.executable, "-m", "pier.backends.python.stub"), env)


@dataclass(slots=True)
class _Packed:
    """A batch ready for its stub: the link it goes over, its requests' ids, the message."""

    link: StubLink
    rids: list[int]
    packer: wire.Packer
    message: m.Exec


class ProcessInstance(ModelInstance):
    may_run_on_event_loop = False  # execute blocks on the child
    awaits_execute = True  # the scheduler runs begin_execute on the loop: no worker thread
    unbatched = True  # Triton hands execute() the list of requests, never a merged batch

    def __init__(self, ctx: ModelContext, where: InstanceContext, command: StubCommand, restart_limit: int = 5,
                 restart_window_s: float = 600.0) -> None:
        self._ctx = ctx
        self._where = where
        self._command = command
        self._model = ctx.spec.name
        self._name = where.name
        self._lock = threading.Lock()
        self._link: StubLink | None = None  # the stub serving now
        self._down = ""  # why the instance cannot serve now ("" while it can)
        self._entries: dict[int, Entry] = {}
        self._ids = itertools.count(1)
        self._metrics_text = ""
        self._waiting: set[asyncio.Task[None]] = set()  # answers that wait off the loop (begin_execute)
        self._aux = AuxHandler(ctx, where.name, self._lock, self._entries)
        policy = RestartPolicy(restart_limit, restart_window_s, RESTART_BACKOFF_S, MAX_BACKOFF_S)
        self._supervisor = Supervisor(self, policy, f"pier-stub-{where.name}", FINALIZE_TIMEOUT_S)
        try:
            self._supervisor.start()
        except Exception as exc:
            raise self._start_error(exc) from None

    def _start_error(self, exc: BaseException) -> PierError:
        """Why a stub could not start, as the load (or the restart's report) says it."""
        if isinstance(exc, PierError):
            return exc
        if isinstance(exc, ChildExited):
            return unavailable(f"Stub process for model '{self._model}' instance '{self._name}' died during "
                               f"initialize(): {exc.cause}")
        return unavailable(f"cannot start the stub process for model '{self._model}': {exc}")

    # ---- the scheduler's side ------------------------------------------------------------------

    def _unhealthy(self) -> str:
        return f"Stub process '{self._name}' is not healthy: {self._down or 'it is starting'}"

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        """A batch from any thread: sent, and its answer read, on that thread."""
        packed = self._pack(requests)
        if not isinstance(packed, _Packed):
            return packed
        return self._run(packed)

    def _run(self, packed: _Packed) -> list[ExecuteResult]:
        """Send a packed batch and wait for its answer, on this thread."""
        link, rids = packed.link, packed.rids
        try:
            self._transmit(packed)
            try:
                link.exec_sock.setblocking(True)  # an event loop's reader (uvloop's) leaves it non-blocking
                got = link.exec_rx.recv()
            except BadMessage as exc:
                return self._unusable(link, rids, exc)
            except OSError:
                got = None
            if got is None:  # the child died (its supervisor shut this channel down)
                link.dead.wait(10)
                return self._died(link, rids)
            if sends := self._sends_unhandled(link, got[0]):
                link.wait_for_sends(sends, SENDS_TIMEOUT_S)
            return self._results(link, rids, *got)
        finally:
            self._done(link)

    def begin_execute(self, requests: Sequence[InferenceRequest], finish: Finish) -> None:
        """A batch from the server's event loop: sent there, and its answer read there when the exec
        socket turns readable; `finish` gets the results in that same callback (no thread, no task)."""
        packed = self._pack(requests)
        if not isinstance(packed, _Packed):
            finish(packed)
            return
        loop = asyncio.get_running_loop()
        if packed.packer.size > LOOP_COPY_BYTES:
            self._on_worker(loop, packed, finish)
            return
        self._transmit(packed)
        link, rids = packed.link, packed.rids
        fd = link.exec_sock.fileno()

        def readable() -> None:
            try:
                got = link.exec_rx.recv(socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except BadMessage as exc:
                loop.remove_reader(fd)
                results = self._unusable(link, rids, exc)
                self._done(link)
                finish(results)
                return
            except OSError:
                got = None
            loop.remove_reader(fd)
            if got is not None and not self._sends_unhandled(link, got[0]) and not self._big(got):
                results = self._results(link, rids, *got)
                self._done(link)
                finish(results)
            else:  # the stub died, or sent responses not handled yet: wait for that off the loop
                task = loop.create_task(self._slow_answer(link, rids, got, finish))
                self._waiting.add(task)
                task.add_done_callback(self._waiting.discard)

        loop.add_reader(fd, readable)

    def _on_worker(self, loop: asyncio.AbstractEventLoop, packed: _Packed, finish: Finish) -> None:
        """A batch too large to copy on the loop: sent and answered on a worker thread, `finish`
        called on the loop."""
        def done(fut: asyncio.Future[list[ExecuteResult]]) -> None:
            exc = fut.exception()
            finish(fut.result() if exc is None else
                   [internal(f"python model '{self._model}' failed: {type(exc).__name__}: {exc}")] * len(packed.rids))

        loop.run_in_executor(None, self._run, packed).add_done_callback(done)

    @staticmethod
    def _big(got: tuple[object, wire.Source]) -> bool:
        """Whether reading this answer's tensors copies more than the loop should (see LOOP_COPY_BYTES)."""
        msg, mapping = got
        return isinstance(msg, m.Result) and wire.borrowed_bytes(msg.results, mapping) > LOOP_COPY_BYTES

    async def _slow_answer(self, link: StubLink, rids: list[int], got: tuple[object, wire.Source] | None,
                           finish: Finish) -> None:
        """An answer not read on the loop: the stub died, its model's sends are not handled yet, or
        its tensors are large (copied out on a worker thread)."""
        loop = asyncio.get_running_loop()
        try:
            if got is None:  # the child died (its supervisor shut this channel down)
                await loop.run_in_executor(None, link.dead.wait, 10)
                results = self._died(link, rids)
            else:
                msg, mapping = got

                def answer() -> list[ExecuteResult]:
                    if sends := self._sends_unhandled(link, msg):
                        link.wait_for_sends(sends, SENDS_TIMEOUT_S)
                    return self._results(link, rids, msg, mapping)

                results = await loop.run_in_executor(None, answer)
        finally:
            self._done(link)
        finish(results)

    def _pack(self, requests: Sequence[InferenceRequest]) -> _Packed | list[ExecuteResult]:
        """The batch for the stub, its large tensors laid out (not copied yet), or the batch's
        results when it cannot go (the stub is down, a request cannot be passed)."""
        n = len(requests)
        with self._lock:
            link = self._link
            if link is None or not link.alive:
                return [unavailable(self._unhealthy())] * n
            rids = [next(self._ids) for _ in requests]
            for rid, r in zip(rids, requests):
                self._entries[rid] = Entry(r, link)
            link.busy = True
        try:
            packer = wire.Packer()
            batch = [wire.request_out(r, packer, rid) for rid, r in zip(rids, requests)]
        except Exception as exc:
            self._settle(link, rids, failed=True)
            self._done(link)
            return [internal(f"cannot pass the request to python model '{self._model}': {exc}")] * n
        return _Packed(link, rids, packer, m.Exec(0, batch))

    @staticmethod
    def _transmit(packed: _Packed) -> None:
        """Send it (its large tensors copied into the channel's shared memory here)."""
        try:
            wire.send(packed.link.exec_sock, packed.message, packed.packer, arena=packed.link.arena)
        except OSError:
            pass  # the child died: the answer reads as end-of-file

    def _done(self, link: StubLink) -> None:
        with self._lock:
            link.busy = False
            if not link.alive:
                link.exec_sock.close()

    def _unusable(self, link: StubLink, rids: list[int], exc: BadMessage) -> list[ExecuteResult]:
        """This batch's answer, unreadable: it fails, the stub serves on."""
        self._settle(link, rids, failed=True)
        return [internal(f"python model '{self._model}' returned an unusable result: {exc}")] * len(rids)

    def _died(self, link: StubLink, rids: list[int]) -> list[ExecuteResult]:
        self._settle(link, rids, failed=True)
        return [internal(link.reason or f"Stub process for model '{self._model}' instance "
                         f"'{self._name}' died")] * len(rids)

    @staticmethod
    def _sends_unhandled(link: StubLink, msg: object) -> int:
        """The count of Send messages to wait for (0: none) before this answer's results: the
        responses the model sent before execute() returned reach their clients first."""
        return msg.sends if isinstance(msg, m.Result) and link.sends_seen < msg.sends else 0

    def _results(self, link: StubLink, rids: list[int], msg: object, mapping: wire.Source) -> list[ExecuteResult]:
        n = len(rids)
        if not isinstance(msg, m.Result):
            self._settle(link, rids, failed=True)
            return [internal(f"python model '{self._model}' returned an unusable result: a "
                             f"{type(msg).__name__} message")] * n
        link.has_metrics = msg.has_metrics
        if link.sends_seen < msg.sends:
            log.error("python model '%s' instance '%s': the responses its model sent before execute() "
                      "returned were not handled within %g s; its results go on without them",
                      self._model, self._name, SENDS_TIMEOUT_S)
        if len(msg.results) != n:
            self._settle(link, rids, failed=True)
            return [internal(f"python model '{self._model}' returned an unusable result: {len(msg.results)} "
                             f"results for {n} requests")] * n
        try:
            results: list[ExecuteResult] = [wire.result_in(w, mapping) or internal("no result")
                                            for w in msg.results]
        except Exception as exc:
            results = [internal(f"python model '{self._model}' returned an unusable result: {exc}")] * n
        self._settle(link, rids, failed=False, results=results)
        return results

    def _settle(self, link: StubLink, rids: list[int], failed: bool,
                results: Sequence[ExecuteResult] = ()) -> None:
        """An execute ended: forget its requests, except decoupled ones still sending (whose child
        died meanwhile: they end here, as `lost` only ends those not executing). A request the
        execute failed is over (its error ends its stream), whatever its model sends later; so is
        one its model rescheduled (the scheduler hands it back as a new request)."""
        orphans = []
        with self._lock:
            for i, rid in enumerate(rids):
                entry = self._entries.get(rid)
                if entry is None:
                    continue
                result = results[i] if i < len(results) else None
                # an error ends the request; a RESCHEDULE too (it comes back as a new request)
                ended = isinstance(result, PierError) or (isinstance(result, Outputs) and result.reschedule)
                if failed or ended or entry.final or entry.request.response_sink is None:
                    del self._entries[rid]
                elif not link.alive:
                    del self._entries[rid]
                    orphans.append(entry.request)
                else:
                    entry.executing = False
        for r in orphans:
            end_stream(r, internal(link.reason))

    def prometheus(self, model: str, version: str) -> str:
        """The model's custom metric families, asked of the child (they live there; they go with it)."""
        link = self._link
        if link is None or not link.alive or not link.has_metrics:
            return ""
        box: list[str] = []
        done = threading.Event()
        qid = next(self._ids)

        def answered(text: str) -> None:
            box.append(text)
            done.set()

        link.calls[qid] = answered
        try:
            wire.send(link.aux_sock, m.MetricsQuery(qid), flags=socket.MSG_DONTWAIT)
            if done.wait(METRICS_TIMEOUT_S):
                self._metrics_text = box[0]
        except OSError:
            pass
        finally:
            link.calls.pop(qid, None)
        return self._metrics_text

    def close(self) -> None:
        """Unload: the decoupled requests still sending finish first, as on Triton (its unload waits
        until every request is released), then finalize() runs in the child, which exits (killed
        after FINALIZE_TIMEOUT_S). A stream its model never ends holds the unload, as on Triton; at
        shutdown --exit-timeout-secs bounds it (the server then kills its children)."""
        self._finish_streams()
        self._supervisor.stop(FINALIZE_TIMEOUT_S + 10)

    def _finish_streams(self) -> None:
        with self._lock:
            link = self._link
            if link is None:
                return

            def sending() -> int:
                return sum(1 for e in self._entries.values() if e.link is link)

            if link.alive and sending():
                log.info("python model '%s' instance '%s' unloads once its %d decoupled request(s) still "
                         "sending end", self._model, self._name, sending())
            link.seen.wait_for(lambda: not link.alive or not sending())  # each Send handled, or its death

    # ---- the supervisor's owner (its thread) ----------------------------------------------------

    def launch(self) -> tuple[Launch, StubLink]:
        exec_parent, exec_child = wire.channel_pair()
        aux_parent, aux_child = wire.channel_pair()
        argv = [*self._command.argv, "--exec-fd", str(exec_child.fileno()), "--aux-fd", str(aux_child.fileno()),
                "--parent-pid", str(os.getpid()), "--model", self._model, "--instance", self._name]
        return (Launch(argv, self._command.env, (exec_child, aux_child)),
                StubLink(exec_parent, aux_parent, self._lock))

    def started(self, child: Child[StubLink]) -> Readers:
        """Send Init; the stub answers Ready once initialize() returned (logs and BLS meanwhile on aux)."""
        ctx, where, link = self._ctx, self._where, child.link
        init = m.Init(ctx.spec, ctx.version, str(ctx.model_dir), str(ctx.version_dir), ctx.config_json, where.name,
                      where.kind, where.device_id, logging.getLogger("pier.python_model").getEffectiveLevel())
        try:
            wire.send(link.exec_sock, init)
        except OSError:  # it died already: the supervisor sees it on the pidfd
            pass

        def answer() -> bool:
            try:
                got = link.exec_rx.recv(socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except BadMessage as exc:
                child.refuse(internal(f"python model '{self._model}': {exc}"))
                return True
            except OSError:
                return False
            if got is None:
                return False
            msg = got[0]
            if isinstance(msg, m.Ready):
                link.has_metrics = msg.has_metrics
                child.ready()
            elif isinstance(msg, m.InitError):
                child.refuse(wire.error_in(msg.error))
            return True

        return {link.exec_sock.fileno(): answer, link.aux_sock.fileno(): lambda: self._aux.read(link)}

    def serving(self, child: Child[StubLink]) -> Readers:
        with self._lock:
            self._link, self._down = child.link, ""
        return {child.link.aux_sock.fileno(): lambda: self._aux.read(child.link)}

    def restarted(self, child: Child[StubLink]) -> None:
        log.info("Stub process for model '%s' instance '%s' restarted", self._model, self._name)
        self._ctx.report_health(self._name, None)

    def lost(self, child: Child[StubLink] | None, end: Exit) -> None:
        prefix = f"Stub process for model '{self._model}' instance '{self._name}'"
        if child is None:
            assert end.error is not None
            cause = f"{prefix} could not be restarted: {self._start_error(end.error).message}"
        else:
            cause = f"{prefix} died: {end.cause}"  # what its requests in flight fail with
        if end.restart_in is None:
            reason = down = (f"{cause}; not restarted: {end.restarts} restarts in the last {end.policy.window_s:g} "
                             "s (load the model again to restart it)")
        else:
            reason = cause
            down = f"{cause}; restarting" + (f" in {end.restart_in:g} s" if end.restart_in else "")
        log.error("%s", down)
        # Reported before any request hears of the death: the server learns that the instance lost
        # its state (its sequences are over) before a client can send the next request of one.
        self._ctx.report_health(self._name, reason)
        streams = []
        with self._lock:
            self._down = down
            if child is not None:
                link = child.link
                link.died(cause)
                self._link = None
                self._metrics_text = ""  # the model's custom metrics went with the process
                ended = [rid for rid, e in self._entries.items() if e.link is link and not e.executing]
                streams = [self._entries.pop(rid).request for rid in ended]
        if child is not None:
            child.link.dead.set()
            for fut in list(child.link.bls):
                fut.cancel()
            for r in streams:
                end_stream(r, internal(cause))

    def ask_to_stop(self, child: Child[StubLink]) -> None:
        """The model unloads: finalize() in the child, which then exits."""
        try:
            wire.send(child.link.exec_sock, m.Finalize())
        except OSError:
            pass

    def stopped(self, child: Child[StubLink] | None, killed: bool) -> None:
        if killed:
            log.warning("Stub process for model '%s' instance '%s' did not exit %g s after finalize: killed",
                        self._model, self._name, FINALIZE_TIMEOUT_S)
        reason = f"model '{self._model}' was unloaded"
        with self._lock:
            if child is not None:
                child.link.died(reason)
            self._link = None
            self._down = reason
            streams = [e.request for e in self._entries.values()]
            self._entries.clear()
        for r in streams:
            end_stream(r, unavailable(reason))
