"""The engine-core process: an LLMEngine stepping in a process of its own (vLLM's EngineCore).

Started by core_client.EngineCoreClient (through pier.ipc's Supervisor) as
`python -m pier.backends.llm.engine_core IN OUT`. It connects a PULL socket to IN (commands from
the server) and a PUSH socket to OUT (events to it), both ZeroMQ ipc:// addresses the server
bound in a private folder; the messages are core_messages.py's: Init once, answered Ready or
LoadFailed, then Add / Abort / Stop in, and per step Outputs (and Refused for a request the
engine would not take) out; Fatal, before it exits, when the engine cannot step any more (a
tensor-parallel rank died: the server restarts this process, and the group with it).

Per-step outputs are the hot path: msgspec's msgpack encodes the RequestOutput dataclasses (about
a microsecond each). The process dies with the server (pier.ipc.processes.die_with_parent:
PR_SET_PDEATHSIG, valid because the supervisor forks it from a thread that outlives it), and
ignores the terminal's Ctrl-C (it runs in its own session too): the server stops it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import zmq

from pier.ipc.messages import BadMessage, encode
from pier.ipc.processes import die_with_parent

from .core_messages import (
    COMMANDS,
    Abort,
    Add,
    EngineFacts,
    Fatal,
    Init,
    LoadFailed,
    Log,
    LoRAUpdated,
    Outputs,
    PrefixCacheReset,
    Progress,
    Ready,
    Refused,
    ResetPrefixCache,
    Stop,
    UpdateLoRA,
)
from .outputs import EngineStats, RequestOutput


class _LogToServer(logging.Handler):
    """The core's log records as Log events, which the server says again on its own log (the
    quantization in use, the FP8 scales derived, the kernels' build): without it the core's INFO
    lines went nowhere. The socket is the main thread's, as every send here; a record from another
    thread (a library's) goes to stderr, which the server's log also receives."""

    def __init__(self, outputs: zmq.Socket, level: int) -> None:
        super().__init__(level)
        self.outputs = outputs
        self.fallback = logging.StreamHandler(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.fallback.emit(record)
            return
        try:
            self.outputs.send(encode(Log(record.levelno, record.name, record.getMessage())))
        except Exception:  # noqa: BLE001 - logging must never fail the engine
            self.handleError(record)


class EngineCore:
    """The step loop: drain commands, step, send what the step produced."""

    def __init__(self, engine: Any, commands: zmq.Socket, outputs: zmq.Socket) -> None:
        self.engine = engine
        self.commands = commands
        self.outputs = outputs
        self._sent_stats: EngineStats | None = None

    def run(self) -> int:
        """Step until Stop (0), or until the engine cannot step any more (1: a tensor-parallel rank
        died; the server hears why first, `Fatal`, and restarts the engine core with its group)."""
        engine = self.engine
        poller = zmq.Poller()
        poller.register(self.commands, zmq.POLLIN)
        if engine.executor is not None:  # a lost rank wakes the idle loop
            poller.register(engine.executor.wake_r, zmq.POLLIN)
        while True:
            if not engine.has_unfinished():
                poller.poll()  # idle: wait for a command
            if (failure := engine.failure()) is not None:
                self.outputs.send(encode(Fatal(failure)))
                return 1
            outs: list[RequestOutput] = []
            if not self._drain(outs):
                return 0
            if engine.has_unfinished():
                try:
                    outs.extend(engine.step())
                except Exception as e:  # noqa: BLE001 - a step failed: fail what is in flight, keep serving
                    if engine.failure() is not None:
                        continue  # the group is broken: said above
                    for rid in list(engine._requests):
                        engine.abort(rid)
                        self._refuse(rid, f"LLM engine step failed: {e!r}")
            self._send(outs)

    def _drain(self, outs: list[RequestOutput]) -> bool:
        """Apply every command waiting; False on stop."""
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                cmd = COMMANDS.decode(raw)
            except BadMessage as exc:  # fails the request it names, if any; said on the server's log either way
                print(f"LLM engine core: {exc}", file=sys.stderr, flush=True)
                if isinstance(exc.ref, str):
                    self._refuse(exc.ref, str(exc))
                continue
            if isinstance(cmd, Add):
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.sampling)
                except ValueError as e:
                    self._refuse(cmd.request_id, str(e))
            elif isinstance(cmd, Abort):
                outs.extend(self.engine.abort(cmd.request_id))
            elif isinstance(cmd, ResetPrefixCache):
                self.outputs.send(encode(PrefixCacheReset(cmd.token, self.engine.reset_prefix_cache())))
            elif isinstance(cmd, UpdateLoRA):
                status, message = self.engine.update_lora(cmd.name, cmd.path, cmd.inplace)
                self.outputs.send(encode(LoRAUpdated(cmd.token, status, message, self.engine.lora_adapters())))
            elif isinstance(cmd, Stop):
                return False

    def _send(self, outs: list[RequestOutput]) -> None:
        stats = self.engine.stats()
        if not outs and stats == self._sent_stats:
            return
        self._sent_stats = stats
        self.outputs.send(encode(Outputs(outs, stats)), copy=False)

    def _refuse(self, request_id: str, message: str) -> None:
        self.outputs.send(encode(Refused(request_id, message)))


def main(argv: list[str]) -> int:
    in_addr, out_addr = argv[0], argv[1]
    die_with_parent(ignore=(signal.SIGINT,))
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(in_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(out_addr)
    if not commands.poll(60_000):
        return 1
    try:
        init = COMMANDS.decode(commands.recv())
        if not isinstance(init, Init):
            raise BadMessage(COMMANDS.protocol, type(init).__name__, None, "expected Init first")
        root = logging.getLogger()
        root.handlers[:] = [_LogToServer(outputs, init.log_level)]
        root.setLevel(init.log_level)
        from .config import EngineConfig
        from .engine import LLMEngine

        engine = LLMEngine(init.model_dir, EngineConfig.from_parameters(init.parameters, **init.overrides),
                           lambda p: outputs.send(encode(Progress(p))), os.path.dirname(in_addr.removeprefix("ipc://")))
        facts = EngineFacts.of(engine)
    except Exception as e:  # noqa: BLE001 - the server reports it as the load's failure
        outputs.send(encode(LoadFailed(type(e).__name__, str(e))))
        outputs.close()
        return 1
    outputs.send(encode(Ready(facts, engine.stats())))
    try:
        return EngineCore(engine, commands, outputs).run()
    finally:
        engine.close()
        outputs.close(linger=1000)
        commands.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
