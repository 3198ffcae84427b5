"""The aux channel, the server's side: what a Python model's stub process sends while its model
runs (backends/python/messages.py), handled on the stub's supervisor thread (process.py):
responses sent through response senders, cancellation checks, log records, BLS requests (run on
the server's event loop through its data plane), model control (on a thread of its own: a load
may take long), and the answers to custom-metrics queries.

A message that does not decode fails only what it concerns: a response for request `rid` ends
that request's stream with the error; a call the stub waits for gets the error as its answer;
anything else is logged as an error (nothing is dropped in silence)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pier.contract.backend import ModelContext
from pier.contract.errors import PierError, internal
from pier.contract.types import InferenceRequest
from pier.ipc import channel as wire
from pier.ipc.messages import BadMessage

from . import messages as m

log = logging.getLogger("pier.backends.python")


@dataclass(eq=False)
class StubLink:
    """One stub process's two channels (a restart makes a new one), and what the server holds for it."""

    exec_sock: socket.socket
    aux_sock: socket.socket
    lock: threading.Lock  # the instance's: guards alive, reason, busy, sends_seen and the instance's requests
    exec_rx: wire.Receiver = field(init=False)
    aux_rx: wire.Receiver = field(init=False)
    alive: bool = True
    reason: str = ""
    dead: threading.Event = field(default_factory=threading.Event)
    busy: bool = False  # a worker thread is using exec_sock
    has_metrics: bool = False
    arena: wire.Arena = field(default_factory=wire.Arena)  # the batches' large tensors
    calls: dict[int, Callable[[str], None]] = field(default_factory=dict)  # metrics queries waiting
    bls: set[Any] = field(default_factory=set)  # BLS calls running for it on the server's loop
    sends_seen: int = 0  # Send messages handled (m.Result.sends)
    seen: threading.Condition = field(init=False)  # sends_seen grew, or the stub died

    def __post_init__(self) -> None:
        self.exec_rx = wire.Receiver(self.exec_sock, m.FROM_STUB)
        self.aux_rx = wire.Receiver(self.aux_sock, m.FROM_STUB)
        self.seen = threading.Condition(self.lock)

    def handled_send(self) -> None:
        """A Send was handled (its response is on its way to the client, or it was unusable)."""
        with self.lock:
            self.sends_seen += 1
            self.seen.notify_all()

    def wait_for_sends(self, sends: int, timeout: float) -> bool:
        """Wait until `sends` Send messages were handled (or the stub died); False on timeout."""
        with self.lock:
            return self.seen.wait_for(lambda: self.sends_seen >= sends or not self.alive, timeout)

    def died(self, reason: str) -> None:
        """Mark the stub gone (the instance's lock held) and wake a worker waiting on its sends."""
        self.alive, self.reason = False, reason
        self.seen.notify_all()

    def reply(self, message: m.ToStub, packer: wire.Packer | None = None) -> None:
        try:
            wire.send(self.aux_sock, message, packer)
        except OSError:  # the child is gone: its supervisor sees it on the pidfd
            pass

    def close(self) -> None:
        """The stub is gone: wake a worker thread still waiting for its answer; close the
        channels (exec_sock stays to a worker using it, which closes it)."""
        with self.lock:
            self.died(self.reason)
            busy = self.busy
        try:
            self.exec_sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not busy:
            self.exec_sock.close()
        self.aux_sock.close()


class Entry:
    """A request the child holds: in an execute, or a decoupled one still sending."""

    __slots__ = ("request", "link", "executing", "final")

    def __init__(self, request: InferenceRequest, link: StubLink) -> None:
        self.request, self.link, self.executing, self.final = request, link, True, False


def end_stream(request: InferenceRequest, error: PierError) -> None:
    sink = request.response_sink
    if sink is None:
        return
    try:
        sink(error, True)
    except Exception:  # the stream is already over
        pass


class AuxHandler:
    """Handles one instance's aux messages (any of its stubs: `link` says which)."""

    def __init__(self, ctx: ModelContext, instance: str, lock: threading.Lock, entries: dict[int, Entry]) -> None:
        self._ctx = ctx
        self._model = ctx.spec.name
        self._name = instance
        self._lock = lock
        self._entries = entries

    def read(self, link: StubLink) -> bool:
        """Handle every aux message waiting (without blocking); False at end-of-file."""
        while True:
            try:
                got = link.aux_rx.recv(socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except BadMessage as exc:
                self._bad(link, exc)
                continue
            except OSError:
                return False
            if got is None:
                return False
            try:
                self._handle(link, *got)
            except Exception:  # a message this side cannot handle must not stop the supervisor
                log.exception("python model '%s': unusable message from its stub process", self._model)

    def _bad(self, link: StubLink, exc: BadMessage) -> None:
        log.error("python model '%s' instance '%s': %s", self._model, self._name, exc)
        error = internal(f"python model '{self._model}': {exc}")
        ref = exc.ref if isinstance(exc.ref, int) else None
        if exc.kind == "Send":
            link.handled_send()
        if exc.kind == "Send" and ref is not None:
            with self._lock:
                entry = self._entries.get(ref)
                if entry is not None:
                    entry.final = True
                    if not entry.executing:
                        self._entries.pop(ref, None)
            if entry is not None:
                end_stream(entry.request, error)
        elif exc.kind == "Bls" and ref is not None:
            link.reply(m.BlsReply(ref, wire.error_out(error)))
            link.reply(m.BlsEnd(ref))  # a stream's end, for a decoupled call (a plain call ignores it)
        elif exc.kind == "Manage" and ref is not None:
            link.reply(m.Managed(ref, wire.error_out(error), None))
        elif exc.kind == "IsCancelled" and ref is not None:
            link.reply(m.Cancelled(ref, False))

    def _handle(self, link: StubLink, msg: m.FromStub, mapping: wire.Source) -> None:
        if isinstance(msg, m.Send):
            try:
                self._send(msg, mapping)
            finally:
                link.handled_send()
        elif isinstance(msg, m.IsCancelled):
            entry = self._entries.get(msg.rid)
            link.reply(m.Cancelled(msg.qid, bool(entry is not None and entry.request.cancelled)))
        elif isinstance(msg, m.Log):
            logging.getLogger(msg.logger).log(msg.level, "%s", msg.text)
        elif isinstance(msg, m.Bls):
            self._bls(link, msg, mapping)
        elif isinstance(msg, m.Manage):
            threading.Thread(target=self._manage, args=(link, msg), daemon=True,
                             name=f"pier-stub-{self._name}-mgmt").start()
        elif isinstance(msg, m.MetricsText):
            waiter = link.calls.get(msg.qid)
            if waiter is not None:
                waiter(msg.text)
        else:  # exec's answers do not belong on aux
            log.error("python model '%s': a %s message on the aux channel", self._model, type(msg).__name__)

    def _send(self, msg: m.Send, mapping: wire.Source) -> None:
        entry = self._entries.get(msg.rid)
        if entry is None or entry.request.response_sink is None:
            return
        if msg.final:
            with self._lock:
                entry.final = True
                if not entry.executing:
                    self._entries.pop(msg.rid, None)
        entry.request.response_sink(wire.result_in(msg.result, mapping), msg.final)

    def _bls(self, link: StubLink, msg: m.Bls, mapping: wire.Source) -> None:
        services = self._ctx.services
        qid = msg.qid
        if services is None:
            error = wire.error_out(internal("BLS requests can only be executed inside a running server"))
            if msg.decoupled:
                link.reply(m.BlsItem(qid, error))
                link.reply(m.BlsEnd(qid))
            else:
                link.reply(m.BlsReply(qid, error))
            return
        request = wire.request_in(msg.request, mapping)

        def send(kind: type[m.BlsItem] | type[m.BlsReply], item: Any) -> None:
            packer = wire.Packer()
            try:
                out = wire.response_out(item, packer)
            except Exception as exc:
                packer, out = wire.Packer(), wire.error_out(internal(f"cannot pass the BLS response on: {exc}"))
            link.reply(kind(qid, out), packer)

        async def run() -> None:
            if msg.decoupled:
                try:
                    async for item in services.infer_stream_async(request):
                        send(m.BlsItem, item)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    send(m.BlsItem, exc if isinstance(exc, PierError) else internal(str(exc)))
                link.reply(m.BlsEnd(qid))
                return
            answer: Any
            try:
                answer = await services.infer_async(request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # errors come back in the response, as in Triton
                answer = exc
            send(m.BlsReply, answer)

        fut = asyncio.run_coroutine_threadsafe(run(), services.event_loop)
        link.bls.add(fut)
        fut.add_done_callback(link.bls.discard)

    def _manage(self, link: StubLink, msg: m.Manage) -> None:
        services = self._ctx.services
        try:
            if services is None:
                raise internal("model control is only available inside a running server")
            value: Any = None
            if msg.op == "load":
                services.load_model(msg.name, msg.arg)
            elif msg.op == "unload":
                services.unload_model(msg.name, msg.arg)
            else:
                value = services.model_ready(msg.name, msg.arg)
            link.reply(m.Managed(msg.qid, None, value))
        except PierError as exc:
            link.reply(m.Managed(msg.qid, wire.error_out(exc), None))
        except Exception as exc:
            link.reply(m.Managed(msg.qid, wire.error_out(internal(str(exc))), None))
