"""The engine-core process: an LLMEngine stepping in a process of its own (vLLM's EngineCore).

Started by core_client.EngineCoreClient as `python -m pier.backends.llm.engine_core IN OUT PARENT`.
It connects a PULL socket to IN (commands from the server) and a PUSH socket to OUT (outputs to
it), both ZeroMQ ipc:// addresses the server bound in a private folder:

    server -> core   pickle: ("init", model_dir, parameters, overrides) once, then
                     ("add", request_id, prompt ids, SamplingParams), ("abort", request_id), ("stop",)
    core -> server   [b"ready", pickle(EngineFacts)] or [b"failed", pickle((type name, message))] once,
                     then per step [b"out", msgpack((outputs, stats))] and
                     [b"fail", msgpack((request_id, message))] for a request the engine refused

Per-step outputs are the hot path: msgspec's msgpack encodes the RequestOutput dataclasses (about
a microsecond each); the rare commands carry SamplingParams by pickle. The process dies with the
server (a watchdog thread checks its parent), and ignores the terminal's Ctrl-C (it
runs in its own session): the server stops it.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from .engine import EngineStats, RequestOutput

READY, FAILED, OUT, FAIL = b"ready", b"failed", b"out", b"fail"
PARENT_CHECK_S = 0.5  # how often the core checks that its server is still there

_encoder = msgspec.msgpack.Encoder()
OUT_DECODER = msgspec.msgpack.Decoder(tuple[list[RequestOutput], EngineStats])
FAIL_DECODER = msgspec.msgpack.Decoder(tuple[str, str])


def _die_with_parent(parent: int) -> None:
    """End this process as soon as the server is gone (it was killed, it crashed): a watchdog
    thread, as PR_SET_PDEATHSIG would fire when the server's *thread* that started it exits."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class EngineCore:
    """The step loop: drain commands, step, send what the step produced."""

    def __init__(self, engine: Any, commands: zmq.Socket, outputs: zmq.Socket, parent: int) -> None:
        self.engine = engine
        self.commands = commands
        self.outputs = outputs
        self.parent = parent
        self._sent_stats: EngineStats | None = None

    def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished():
                self.commands.poll()  # idle: wait for a command
            outs: list[RequestOutput] = []
            if not self._drain(outs):
                return
            if engine.has_unfinished():
                try:
                    outs.extend(engine.step())
                except Exception as e:  # noqa: BLE001 - a step failed: fail what is in flight, keep serving
                    for rid in list(engine._requests):
                        engine.abort(rid)
                        self._send_fail(rid, f"LLM engine step failed: {e!r}")
            self._send(outs)

    def _drain(self, outs: list[RequestOutput]) -> bool:
        """Apply every command waiting; False on stop."""
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            cmd = pickle.loads(raw)
            if cmd[0] == "add":
                _, rid, ids, sampling = cmd
                try:
                    self.engine.add_request(rid, ids, sampling)
                except ValueError as e:
                    self._send_fail(rid, str(e))
            elif cmd[0] == "abort":
                outs.extend(self.engine.abort(cmd[1]))
            elif cmd[0] == "stop":
                return False

    def _send(self, outs: list[RequestOutput]) -> None:
        stats = self.engine.stats()
        if not outs and stats == self._sent_stats:
            return
        self._sent_stats = stats
        self.outputs.send_multipart([OUT, _encoder.encode((outs, stats))], copy=False)

    def _send_fail(self, request_id: str, message: str) -> None:
        self.outputs.send_multipart([FAIL, _encoder.encode((request_id, message))])


def main(argv: list[str]) -> int:
    in_addr, out_addr, parent = argv[0], argv[1], int(argv[2])
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(in_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(out_addr)
    if not commands.poll(60_000):
        return 1
    _, model_dir, parameters, overrides = pickle.loads(commands.recv())
    try:
        from .async_engine import EngineFacts
        from .engine import LLMEngine

        engine = LLMEngine.from_parameters(model_dir, parameters, **overrides)
        facts = EngineFacts.of(engine)
    except Exception as e:  # noqa: BLE001 - the server reports it as the load's failure
        outputs.send_multipart([FAILED, pickle.dumps((type(e).__name__, str(e)))])
        outputs.close()
        return 1
    outputs.send_multipart([READY, pickle.dumps((facts, engine.stats()))])
    try:
        EngineCore(engine, commands, outputs, parent).run()
    finally:
        outputs.close(linger=1000)
        commands.close(linger=0)
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
