"""EngineCoreClient: the LLM engine in its own process (engine_core.py), streamed to asyncio callers.

The server process keeps tokenization, the streams and everything the frontends do; the core
process schedules, runs the model, samples and detokenizes. A pier.ipc Supervisor starts, watches
and restarts the core; this client is its owner, and keeps only its transport and what a death
fails. Commands (core_messages.py) go over a ZeroMQ PUSH socket (under a lock: several event
loops may send); events come back on a PULL socket, read on the supervisor's thread, which hands
each step's outputs to the streams' event loops as AsyncLLMEngine's step thread does.

When the core process dies (OOM-kill, `kill -9`, a crash in native code), the supervisor sees
its pidfd at once: what it sent before it died is delivered, every request in flight fails with
EngineDeadError naming how it died, the health callback reports the reason (the server marks the
model UNAVAILABLE), and the core is restarted, at most `MAX_RESTARTS` times in
`RESTART_WINDOW_S` (the first at once, then after 1, 2, 4, ... s); past that it stays down until
the model is reloaded.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pier.contract.backend import LoadProgress
from pier.ipc.child import Child, ChildExited, Exit, Launch, RestartPolicy, drop_scratch, scratch_folder
from pier.ipc.messages import BadMessage, encode
from pier.ipc.supervisor import Readers, Supervisor

from . import core_messages as cm
from .async_engine import EngineClient, EngineDeadError
from .config import EngineConfig
from .tokenizer import Tokenizer

log = logging.getLogger("pier.llm")

MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
RESTART_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
STOP_TIMEOUT_S = 30.0


class _Core:
    """One core process's two sockets (a restart makes new ones, on new addresses)."""

    def __init__(self, ctx: zmq.Context, folder: str, generation: int, send_lock: threading.Lock) -> None:
        self.commands = ctx.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.setsockopt(zmq.SNDHWM, 0)  # never full: a send fails only with no core connected
        self.outputs = ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.addresses = f"ipc://{folder}/in-{generation}", f"ipc://{folder}/out-{generation}"
        self.commands.bind(self.addresses[0])
        self.outputs.bind(self.addresses[1])
        self.ready: cm.Ready | None = None
        self._send_lock = send_lock

    def close(self) -> None:
        with self._send_lock:
            self.commands.close(linger=0)
        self.outputs.close(linger=0)


class EngineCoreClient(EngineClient):
    """The engine in a child process; same API as AsyncLLMEngine."""

    def __init__(self, model_dir: str | Path, parameters: Mapping[str, str], overrides: Mapping[str, Any],
                 on_health: Callable[[str | None], None] | None = None,
                 on_progress: Callable[[LoadProgress], None] | None = None) -> None:
        config = EngineConfig.from_parameters(parameters, **overrides)  # bad values fail here, at once
        folder = Path(config.model.model_path or model_dir)
        self._init = cm.Init(str(model_dir), dict(parameters), dict(overrides), logging.getLogger().getEffectiveLevel())
        self._on_health = on_health or (lambda reason: None)
        self._on_progress = on_progress or (lambda progress: None)  # the core's load, as it reports it
        self._zmq = zmq.Context()
        self._dir = scratch_folder("pier-llm-core-")
        self._send_lock = threading.Lock()
        self._core: _Core | None = None  # the one serving now
        self._generation = 0
        self._pid = 0
        self._died = ""  # how the last core died
        self._fatal = ""  # why the serving core said it exits (cm.Fatal)
        self._dead: str | None = None
        policy = RestartPolicy(MAX_RESTARTS, RESTART_WINDOW_S, RESTART_BACKOFF_S, MAX_BACKOFF_S)
        self._supervisor = Supervisor(self, policy, "llm-core", STOP_TIMEOUT_S)
        try:
            self._tokenizer = Tokenizer(folder)
            self._supervisor.start()  # the first core's `serving` makes this client whole (EngineClient's part)
        except ChildExited as exc:
            self._cleanup()
            raise RuntimeError(f"the LLM engine process {exc.cause} while loading") from None
        except BaseException:
            self._cleanup()
            raise

    @classmethod
    def from_parameters(cls, model_dir: str | Path, parameters: Mapping[str, str],
                        on_health: Callable[[str | None], None] | None = None,
                        on_progress: Callable[[LoadProgress], None] | None = None, **overrides: object
                        ) -> EngineCoreClient:
        return cls(model_dir, parameters, overrides, on_health, on_progress)

    @property
    def pid(self) -> int:
        """The core process's pid (for operators and fault tests): the one serving, or the last one."""
        return self._pid

    def unavailable_reason(self) -> str | None:
        return super().unavailable_reason() or self._dead

    # -- commands ----------------------------------------------------------------------------------

    def _send(self, command: cm.Add | cm.Abort | cm.ResetPrefixCache | cm.UpdateLoRA) -> None:
        data = encode(command)
        with self._send_lock:
            core = self._core
            try:
                if core is None:
                    raise zmq.ZMQError(zmq.ENOTSOCK)
                core.commands.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again: no core connected (it died); ENOTSOCK: being replaced
                raise EngineDeadError(self._dead or "the LLM engine process is not running") from None

    def shutdown(self) -> None:
        self._stopped = True
        self._supervisor.stop()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._cleanup()

    def _cleanup(self) -> None:
        self._zmq.term()
        drop_scratch(self._dir)

    # -- the supervisor's owner (its thread) ------------------------------------------------------

    def launch(self) -> tuple[Launch, _Core]:
        self._generation += 1
        core = _Core(self._zmq, self._dir, self._generation, self._send_lock)
        return Launch([sys.executable, "-m", "pier.backends.llm.engine_core", *core.addresses],
                      new_session=True), core

    def started(self, child: Child[_Core]) -> Readers:
        """Send Init once the core has connected; its Ready (or LoadFailed) settles the start."""
        core = child.link

        def send_init() -> bool:
            if not core.commands.getsockopt(zmq.EVENTS) & zmq.POLLOUT:  # not connected yet
                return True
            core.commands.send(encode(self._init))
            return False

        def answer() -> bool:
            for event in self._events(core, lambda exc, data: child.refuse(RuntimeError(str(exc)))):
                if isinstance(event, cm.Progress):
                    self._on_progress(event.progress)
                    if child.generation > 1 and self._dead:  # restarting: UNAVAILABLE says how it goes
                        self._on_health(f"{self._dead}; restarting: {event.progress}")
                elif isinstance(event, cm.Ready):
                    core.ready = event
                    child.ready()
                elif isinstance(event, cm.LoadFailed):
                    child.refuse(ValueError(event.message) if event.kind in ("ValueError", "KeyError") else
                                 RuntimeError(f"{event.kind}: {event.message}"))
            return True

        return {core.commands.getsockopt(zmq.FD): send_init, core.outputs.getsockopt(zmq.FD): answer}

    def serving(self, child: Child[_Core]) -> Readers:
        core = child.link
        assert core.ready is not None
        if child.generation == 1:  # the first core: the client is made from what it reported
            super().__init__(self._tokenizer, core.ready.facts, core.ready.stats)
        else:
            self._set_stats(core.ready.stats)
            self.lora_adapters = dict(core.ready.facts.lora_adapters or {})  # a new core serves its startup set
        with self._send_lock:
            self._core, self._pid = core, child.pid
        log.info("LLM engine core started (pid %d)", child.pid)
        return {core.outputs.getsockopt(zmq.FD): lambda: self._read(core)}

    def restarted(self, child: Child[_Core]) -> None:
        self._dead = None
        log.info("LLM engine core restarted (pid %d)", child.pid)
        self._on_health(None)

    def lost(self, child: Child[_Core] | None, end: Exit) -> None:
        if child is not None:
            with self._send_lock:
                self._core = None
            self._died = reason = f"the LLM engine process (pid {child.pid}) {end.cause}"
            if self._fatal:  # it said why before it exited (a tensor-parallel rank died)
                self._died = reason = f"the LLM engine's {self._fatal}"
                self._fatal = ""
            log.error("%s; its requests failed", reason)
            self._dead = reason
            self._on_health(reason)  # first: the model is UNAVAILABLE before any client hears of the failure
            self._fail_all(EngineDeadError(reason))
        else:
            error = end.error
            if isinstance(error, ChildExited):
                error = RuntimeError(f"the LLM engine process {error.cause} while loading")
            self._dead = reason = f"{self._died}; the restart failed: {error}"
            log.error("%s", reason)
            self._on_health(reason)
        if end.restart_in is None:
            self._dead = (f"{reason}; not restarted: it died {end.restarts + 1} times in "
                          f"{end.policy.window_s:.0f} s (reload the model to start it again)")
            self._on_health(self._dead)

    def ask_to_stop(self, child: Child[_Core]) -> None:
        try:
            with self._send_lock:
                child.link.commands.send(encode(cm.Stop()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def stopped(self, child: Child[_Core] | None, killed: bool) -> None:
        with self._send_lock:
            self._core = None
        self._fail_all(EngineDeadError("the engine was shut down"))

    # -- the core's events ---------------------------------------------------------------------------

    def _read(self, core: _Core) -> bool:
        for event in self._events(core, self._unreadable):
            if isinstance(event, cm.Outputs):
                self._set_stats(event.stats)
                self._dispatch(event.outputs)
            elif isinstance(event, cm.Refused):
                self._fail(event.request_id, ValueError(event.message))
            elif isinstance(event, cm.PrefixCacheReset):
                self._answer(event.token, event.ok)
            elif isinstance(event, cm.Fatal):
                self._fatal = event.message  # what `lost` says, as the process exits next
            elif isinstance(event, cm.LoRAUpdated):
                self._answer(event.token, event)
        return True

    @staticmethod
    def _events(core: _Core, on_bad: Callable[[BadMessage, memoryview], None]) -> list[cm.Event]:
        """Every event waiting (without blocking); one that does not decode goes to `on_bad`,
        said on the log. The core's log records are said on the server's log here, not returned."""
        events: list[cm.Event] = []
        while True:
            try:
                frame = core.outputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return events
            try:
                event = cm.EVENTS.decode(frame.buffer)
                if isinstance(event, cm.Log):
                    logging.getLogger(event.logger).log(event.level, "%s", event.message)
                else:
                    events.append(event)
            except BadMessage as exc:
                log.error("%s", exc)
                on_bad(exc, frame.buffer)

    def _unreadable(self, exc: BadMessage, data: memoryview) -> None:
        """An event that does not decode fails the requests it names (a Refused's id, the request
        ids of an Outputs' entries, as far as a plain msgpack read tells), and no other."""
        rids: list[str] = [exc.ref] if isinstance(exc.ref, str) else []
        if not rids and exc.kind == "Outputs":
            try:
                raw = msgspec.msgpack.decode(data)
                rids = [o["request_id"] for o in raw[1] if isinstance(o, dict) and isinstance(o.get("request_id"), str)]
            except Exception:  # nothing to tell
                pass
        for rid in rids:
            self._fail(rid, RuntimeError(str(exc)))
