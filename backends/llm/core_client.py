"""EngineCoreClient: the LLM engine in its own process (engine_core.py), streamed to asyncio callers.

The server process keeps tokenization, the streams and everything the frontends do; the core
process schedules, runs the model, samples and detokenizes. Commands go over a ZeroMQ PUSH socket
(under a lock: several event loops may send), outputs come back on a PULL socket read by one
thread here, which hands them to each stream's event loop as AsyncLLMEngine's step thread does.

When the core process dies (OOM-kill, `kill -9`, a crash in native code), the reader thread sees
its pidfd at once: every request in flight fails with EngineDeadError naming how it died, the
health callback reports the reason (the server marks the model UNAVAILABLE), and the core is
restarted, at most `MAX_RESTARTS` times in `RESTART_WINDOW_S`; past that it stays down until the
model is reloaded.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import zmq

from pier.ipc.processes import exit_cause

from . import engine_core as core
from .async_engine import EngineClient, EngineDeadError, EngineFacts
from .config import EngineConfig
from .engine import EngineStats
from .tokenizer import Tokenizer

log = logging.getLogger("pier.llm")

MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
STOP_TIMEOUT_S = 30.0


class _Process:
    """One core process and its two sockets."""

    def __init__(self, ctx: zmq.Context, folder: str, generation: int) -> None:
        self.commands = ctx.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.setsockopt(zmq.SNDHWM, 0)  # never full: a send fails only with no core connected
        self.outputs = ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        in_addr, out_addr = f"ipc://{folder}/in-{generation}", f"ipc://{folder}/out-{generation}"
        self.commands.bind(in_addr)
        self.outputs.bind(out_addr)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pier.backends.llm.engine_core", in_addr, out_addr, str(os.getpid())],
            stdin=subprocess.DEVNULL, start_new_session=True)
        self.pidfd = os.pidfd_open(self.proc.pid)

    def close(self) -> None:
        """Idempotent (a core that died is closed when noticed, and again at shutdown)."""
        self.commands.close(linger=0)
        self.outputs.close(linger=0)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class EngineCoreClient(EngineClient):
    """The engine in a child process; same API as AsyncLLMEngine."""

    def __init__(self, model_dir: str | Path, parameters: Mapping[str, str], overrides: Mapping[str, Any],
                 on_health: Callable[[str | None], None] | None = None) -> None:
        config = EngineConfig.from_parameters(parameters, **overrides)  # bad values fail here, at once
        folder = Path(config.model_path or model_dir)
        self._init = ("init", str(model_dir), dict(parameters), dict(overrides))
        self._on_health = on_health or (lambda reason: None)
        self._zmq = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="pier-llm-core-")
        self._send_lock = threading.Lock()
        self._generation = 0
        self._restarts: list[float] = []
        self._dead: str | None = None
        self._stopped = False
        try:
            tokenizer = Tokenizer(folder)
            self._core, facts, stats = self._start()
        except BaseException:
            self._cleanup()
            raise
        super().__init__(tokenizer, facts, stats)
        self._reader = threading.Thread(target=self._read, name="llm-core-reader", daemon=True)
        self._reader.start()

    @classmethod
    def from_parameters(cls, model_dir: str | Path, parameters: Mapping[str, str],
                        on_health: Callable[[str | None], None] | None = None, **overrides: object
                        ) -> EngineCoreClient:
        return cls(model_dir, parameters, overrides, on_health)

    @property
    def pid(self) -> int:
        """The core process's pid (for operators and fault tests)."""
        return self._core.proc.pid

    def unavailable_reason(self) -> str | None:
        return super().unavailable_reason() or self._dead

    # -- starting ----------------------------------------------------------------------------------

    def _start(self) -> tuple[_Process, EngineFacts, EngineStats]:
        """Spawn a core and wait until its engine has loaded (blocking; as long as the load takes).
        Raises ValueError with the engine's reason when it cannot load, RuntimeError if it dies."""
        self._generation += 1
        p = _Process(self._zmq, self._dir, self._generation)
        try:
            poller = zmq.Poller()
            poller.register(p.commands, zmq.POLLOUT)  # writable once the core has connected
            poller.register(p.outputs, zmq.POLLIN)
            poller.register(p.pidfd, zmq.POLLIN)
            while True:
                events = dict(poller.poll(500))
                if self._stopped:  # shut down while (re)starting: this core goes too
                    raise EngineDeadError("the engine was shut down")
                if events.get(p.commands, 0) & zmq.POLLOUT:
                    p.commands.send(pickle.dumps(self._init))
                    poller.unregister(p.commands)
                    continue
                if p.outputs in events:
                    kind, payload = p.outputs.recv_multipart()
                    if kind == core.READY:
                        facts, stats = pickle.loads(payload)
                        log.info("LLM engine core started (pid %d)", p.proc.pid)
                        return p, facts, stats
                    name, message = pickle.loads(payload)
                    p.proc.wait(timeout=STOP_TIMEOUT_S)
                    raise ValueError(message) if name in ("ValueError", "KeyError") else RuntimeError(
                        f"{name}: {message}")
                if p.pidfd in events:
                    raise RuntimeError(f"the LLM engine process {exit_cause(p.proc.wait())} while loading")
        except BaseException:
            self._stop_process(p)
            raise

    def _stop_process(self, p: _Process) -> None:
        if p.proc.poll() is None:
            try:
                with self._send_lock:
                    p.commands.send(pickle.dumps(("stop",)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                p.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        p.close()

    # -- commands ----------------------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        data = pickle.dumps(command)
        with self._send_lock:
            try:
                self._core.commands.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again: no core connected (it died); ENOTSOCK: being replaced
                raise EngineDeadError(self._dead or "the LLM engine process is not running") from None

    def shutdown(self) -> None:
        self._stopped = True
        self._reader.join(timeout=STOP_TIMEOUT_S + 5)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._cleanup()

    def _cleanup(self) -> None:
        core_ = getattr(self, "_core", None)
        if core_ is not None:
            self._stop_process(core_)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- the reader thread -------------------------------------------------------------------------

    def _read(self) -> None:
        while not self._stopped:
            p = self._core
            poller = zmq.Poller()
            poller.register(p.outputs, zmq.POLLIN)
            poller.register(p.pidfd, zmq.POLLIN)
            while not self._stopped:
                events = dict(poller.poll(500))
                if p.outputs in events:
                    self._drain(p)
                if p.pidfd in events:
                    self._drain(p)  # what it sent before it died still counts
                    self._died(p)
                    break
            if self._dead is not None and not self._stopped:
                return  # not restarted: down until a reload

    def _drain(self, p: _Process) -> None:
        while True:
            try:
                kind, payload = p.outputs.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if kind.bytes == core.OUT:
                outs, stats = core.OUT_DECODER.decode(payload.buffer)
                self._set_stats(stats)
                self._dispatch(outs)
            elif kind.bytes == core.FAIL:
                rid, message = core.FAIL_DECODER.decode(payload.buffer)
                self._fail(rid, ValueError(message))

    def _died(self, p: _Process) -> None:
        reason = f"the LLM engine process (pid {p.proc.pid}) {exit_cause(p.proc.wait())}"
        log.error("%s; its requests failed", reason)
        self._dead = reason
        self._on_health(reason)  # first: the model is UNAVAILABLE before any client hears of the failure
        self._fail_all(EngineDeadError(reason))
        p.close()
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
        if len(self._restarts) >= MAX_RESTARTS:
            self._dead = (f"{reason}; not restarted: it died {MAX_RESTARTS + 1} times in "
                          f"{RESTART_WINDOW_S:.0f} s (reload the model to start it again)")
            self._on_health(self._dead)
            return
        self._restarts.append(now)
        try:
            self._core, _, stats = self._start()
        except (ValueError, RuntimeError, OSError) as e:  # EngineDeadError: shut down meanwhile
            self._dead = f"{reason}; the restart failed: {e}"
            self._on_health(self._dead)
            return
        self._set_stats(stats)
        self._dead = None
        log.info("LLM engine core restarted (pid %d)", self._core.proc.pid)
        self._on_health(None)
