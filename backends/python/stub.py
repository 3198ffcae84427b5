"""The stub process of one Python model instance (Triton's `triton_python_backend_stub`): it
loads model.py with the same PythonInstance the in-process mode uses, so pb_utils behaves the
same, and talks to the server over two channels it inherits (server/ipc/channel.py):

- exec: the server sends Init, then Exec (a batch of requests) and Finalize, one at a time;
  this process's main thread answers each (Ready / InitError, Result, Finalized);
- aux: everything that crosses while a model runs: responses sent through response senders
  (Send), BLS requests and model control (Bls, Manage), cancellation checks (IsCancelled), log
  records (Log), and the server's custom-metrics queries (MetricsQuery), read here by one reader
  thread. (The messages: backends/python/messages.py.)

The process dies with the server (pier.ipc.processes.die_with_parent: PR_SET_PDEATHSIG and a
parent-pid check; end-of-file on either channel too). Its OOM score is raised by 500, so that
when a model's memory grows without bound the kernel kills the stub (restarted) rather than the
server. SIGINT and SIGTERM are ignored (a Ctrl-C or a process-group SIGTERM reaches the server,
which drains and then finalizes its stubs).

Run by the server (pier.ipc.supervisor) as `python -m pier.backends.python.stub --exec-fd N --aux-fd M
--parent-pid P --model M --instance I`.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import itertools
import logging
import os
import queue
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from pier.backends.python import triton_python_backend_utils as pb_utils
from pier.backends.python.backend import PythonInstance
from pier.backends.python.bls import BlsClient
from pier.contract.backend import InstanceContext, ModelContext
from pier.contract.errors import PierError, internal
from pier.contract.types import ExecuteResult, InferenceRequest, InferenceResponse, Outputs
from pier.ipc import channel as wire
from pier.ipc.messages import BadMessage
from pier.ipc.processes import die_with_parent

from . import messages as m

Reply = tuple[m.Answer, wire.Source]


class _RemoteRequest(InferenceRequest):
    """A request this process executes: `cancelled` asks the server (whose request it mirrors)."""

    __slots__ = ("_stub", "_rid", "_seen")

    @property  # type: ignore[override]
    def cancelled(self) -> bool:
        if getattr(self, "_seen", False):
            return True
        stub = getattr(self, "_stub", None)
        if stub is None:
            return False
        msg, _ = stub.call(lambda qid: m.IsCancelled(qid, self._rid))  # type: ignore[attr-defined]
        self._seen = isinstance(msg, m.Cancelled) and msg.cancelled
        return self._seen

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        pass


class _LogForwarder(logging.Handler):
    def __init__(self, stub: Stub) -> None:
        super().__init__()
        self._stub = stub

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            wire.send(self._stub.aux, m.Log(record.name, record.levelno, text))
        except Exception:  # the server is gone or the record cannot be formatted
            pass


class RemoteServices:
    """pier.contract.backend.ServerServices for BlsClient (and so pb_utils) in this process: each
    call is a message to the server, which runs it through its data plane."""

    def __init__(self, stub: Stub) -> None:
        self._stub = stub

    def _request(self, request: InferenceRequest) -> tuple[wire.WireRequest, wire.Packer]:
        packer = wire.Packer()
        return wire.request_out(request, packer), packer

    def infer(self, request: InferenceRequest) -> InferenceResponse:
        w, packer = self._request(request)
        msg, mapping = self._stub.call(lambda qid: m.Bls(qid, False, w), packer=packer)
        response = _response(msg, mapping)
        if isinstance(response, PierError):
            raise response
        return response

    def infer_stream(self, request: InferenceRequest) -> Iterator[InferenceResponse | PierError]:
        w, packer = self._request(request)
        items: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        qid = self._stub.open(lambda msg, mapping: items.put((msg, mapping)))
        self._stub.send(m.Bls(qid, True, w), packer)
        while True:
            msg, mapping = items.get()
            if isinstance(msg, m.BlsEnd):
                self._stub.close_call(qid)
                return
            yield _response(msg, mapping)

    async def infer_async(self, request: InferenceRequest) -> InferenceResponse:
        w, packer = self._request(request)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()

        def resolve(reply: Reply) -> None:
            if not fut.done():
                fut.set_result(reply)

        def done(msg: m.Answer, mapping: wire.Source) -> None:
            loop.call_soon_threadsafe(resolve, (msg, mapping))

        qid = self._stub.open(done)
        self._stub.send(m.Bls(qid, False, w), packer)
        try:
            msg, mapping = await fut
        finally:
            self._stub.close_call(qid)
        response = _response(msg, mapping)
        if isinstance(response, PierError):
            raise response
        return response

    async def infer_stream_async(self, request: InferenceRequest) -> AsyncIterator[InferenceResponse | PierError]:
        w, packer = self._request(request)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Reply] = asyncio.Queue()

        def put(msg: m.Answer, mapping: wire.Source) -> None:
            loop.call_soon_threadsafe(items.put_nowait, (msg, mapping))

        qid = self._stub.open(put)
        self._stub.send(m.Bls(qid, True, w), packer)
        try:
            while True:
                msg, mapping = await items.get()
                if isinstance(msg, m.BlsEnd):
                    return
                yield _response(msg, mapping)
        finally:
            self._stub.close_call(qid)

    def _manage(self, op: str, name: str, arg: Any) -> Any:
        msg, _ = self._stub.call(lambda qid: m.Manage(qid, op, name, arg))
        if not isinstance(msg, m.Managed):
            raise internal(f"model control: the server answered {type(msg).__name__}")
        if msg.error is not None:
            raise wire.error_in(msg.error)
        return msg.value

    def load_model(self, name: str, parameters: dict[str, Any]) -> None:
        self._manage("load", name, parameters)

    def unload_model(self, name: str, parameters: dict[str, Any]) -> None:
        self._manage("unload", name, parameters)

    def model_ready(self, name: str, version: str) -> bool:
        return bool(self._manage("ready", name, version))

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        raise internal("the server's event loop is not reachable from a stub process")


def _response(msg: m.Answer, mapping: wire.Source) -> InferenceResponse | PierError:
    if isinstance(msg, (m.BlsReply, m.BlsItem)):
        return wire.response_in(msg.response, mapping)
    return internal(f"BLS: the server answered {type(msg).__name__}")


class Stub:
    def __init__(self, exec_sock: socket.socket, aux_sock: socket.socket) -> None:
        self.exec = exec_sock
        self.aux = aux_sock
        self._exec_rx = wire.Receiver(exec_sock, m.TO_STUB)
        self._aux_rx = wire.Receiver(aux_sock, m.TO_STUB)
        self._ids = itertools.count(1)
        self._calls: dict[int, Callable[[m.Answer, wire.Source], None]] = {}
        self.instance: PythonInstance | None = None
        self._arena = wire.Arena()  # the results' large tensors
        self._sends_lock = threading.Lock()
        self._sends = 0  # Send messages written on aux (m.Result.sends)

    # ---- calls to the server ---------------------------------------------------------------

    def open(self, handler: Callable[[m.Answer, wire.Source], None]) -> int:
        qid = next(self._ids)
        self._calls[qid] = handler
        return qid

    def close_call(self, qid: int) -> None:
        self._calls.pop(qid, None)

    def send(self, message: m.FromStub, packer: wire.Packer | None = None) -> None:
        wire.send(self.aux, message, packer)

    def call(self, make: Callable[[int], m.FromStub], packer: wire.Packer | None = None) -> Reply:
        """Send `make(qid)` and wait for the server's answer to it (the server answers each)."""
        box: list[Reply] = []
        ready = threading.Event()

        def handler(msg: m.Answer, mapping: wire.Source) -> None:
            box.append((msg, mapping))
            ready.set()

        qid = self.open(handler)
        try:
            self.send(make(qid), packer)
            ready.wait()
        finally:
            self.close_call(qid)
        return box[0]

    def _read_aux(self) -> None:
        while True:
            try:
                got = self._aux_rx.recv()
            except BadMessage as exc:  # loudly, on the server's log; a call it concerns hears of it
                self._unreadable(exc)
                continue
            except OSError:
                got = None
            if got is None:  # the server is gone
                os._exit(0)
            msg, mapping = got
            if isinstance(msg, m.MetricsQuery):
                text = self.instance.prometheus("", "") if self.instance is not None else ""
                try:  # never block this thread on the server: it would not read its answers
                    wire.send(self.aux, m.MetricsText(msg.qid, text), flags=socket.MSG_DONTWAIT)
                except OSError:
                    pass
                continue
            if isinstance(msg, (m.BlsReply, m.BlsItem, m.BlsEnd, m.Cancelled, m.Managed)):
                handler = self._calls.get(msg.qid)
                if handler is not None:
                    handler(msg, mapping)
                continue
            logging.getLogger("pier.backends.python").error("stub: a %s message on the aux channel",
                                                             type(msg).__name__)

    def _unreadable(self, exc: BadMessage) -> None:
        logging.getLogger("pier.backends.python").error("stub: %s", exc)
        qid = exc.ref if isinstance(exc.ref, int) else -1
        handler = self._calls.get(qid)
        if handler is None:
            return
        error = wire.error_out(internal(str(exc)))
        if exc.kind in ("BlsReply", "BlsItem"):
            handler(m.BlsReply(qid, error), None)
        elif exc.kind == "Managed":
            handler(m.Managed(qid, error, None), None)
        elif exc.kind == "Cancelled":
            handler(m.Cancelled(qid, False), None)

    # ---- the model ---------------------------------------------------------------------------

    def _sink(self, rid: int, name: str) -> Callable[[Outputs | PierError | None, bool], None]:
        def sink(result: Outputs | PierError | None, final: bool) -> None:
            packer = wire.Packer()
            w: wire.WireResult | None
            try:
                w = wire.result_out(result, packer)
            except Exception as exc:
                packer = wire.Packer()
                w = wire.error_out(internal(f"python model '{name}' sent an unusable tensor: {exc}"))
            with self._sends_lock:  # counted in the order written: m.Result.sends
                wire.send(self.aux, m.Send(rid, w, final), packer)
                self._sends += 1
        return sink

    def _results(self, results: list[ExecuteResult], name: str) -> tuple[list[wire.WireResult | None], wire.Packer]:
        packer = wire.Packer()
        out: list[wire.WireResult | None] = []
        for result in results:
            try:
                out.append(wire.result_out(result, packer))
            except Exception as exc:
                out.append(wire.error_out(internal(f"python model '{name}' returned an unusable tensor: {exc}")))
        return out, packer

    def run(self) -> None:
        try:
            got = self._exec_rx.recv()
        except BadMessage as exc:
            self._end(m.InitError(wire.error_out(internal(f"the stub process cannot read its model: {exc}"))))
        if got is None:
            os._exit(0)
        init = got[0]
        if not isinstance(init, m.Init):
            self._end(m.InitError(wire.error_out(internal(f"the stub expected Init, got {type(init).__name__}"))))
        root = logging.getLogger()
        root.handlers[:] = [_LogForwarder(self)]
        root.setLevel(init.log_level)
        threading.Thread(target=self._read_aux, name="pier-stub-aux", daemon=True).start()
        services = RemoteServices(self)
        pb_utils._bls = BlsClient(services)  # type: ignore[arg-type]
        ctx = ModelContext(spec=init.spec, version=init.version, model_dir=Path(init.model_dir),
                           version_dir=Path(init.version_dir), config_json=init.config_json,
                           services=services)  # type: ignore[arg-type]
        where = InstanceContext(init.instance, init.kind, init.device_id)
        name = ctx.spec.name
        try:
            instance = PythonInstance(ctx, where)
        except PierError as exc:
            self._end(m.InitError(wire.error_out(exc)))
        except BaseException as exc:
            self._end(m.InitError(wire.error_out(internal(f"python model '{name}' failed to load: "
                                                          f"{type(exc).__name__}: {exc}"))))
        self.instance = instance
        wire.send(self.exec, m.Ready(bool(pb_utils._families)))
        self._serve(instance, name)

    def _serve(self, instance: PythonInstance, name: str) -> None:
        while True:
            try:
                got = self._exec_rx.recv()
            except BadMessage as exc:  # this batch fails: no result for any of its requests (the server says so)
                logging.getLogger("pier.backends.python").error("stub: %s", exc)
                wire.send(self.exec, m.Result(0, [], bool(pb_utils._families), self._sends))
                continue
            if got is None:  # the server is gone
                os._exit(0)
            msg, mapping = got
            if isinstance(msg, m.Finalize):
                instance.close()
                self._end(m.Finalized())
            if not isinstance(msg, m.Exec):
                logging.getLogger("pier.backends.python").error("stub: a %s message on the exec channel",
                                                                 type(msg).__name__)
                continue
            requests = []
            for w in msg.batch:
                request = wire.request_in(w, mapping, _RemoteRequest)
                request._stub, request._rid = self, w.rid  # type: ignore[attr-defined]
                if w.has_sink:
                    request.response_sink = self._sink(w.rid, name)
                requests.append(request)
            try:
                results = instance.execute(requests)
            except BaseException as exc:  # PythonInstance catches the model's own exceptions
                results = [internal(f"python model '{name}' failed: {type(exc).__name__}: {exc}")] * len(requests)
            out, packer = self._results(results, name)
            with self._sends_lock:  # every response the model sent before this point goes first
                sends = self._sends
            wire.send(self.exec, m.Result(msg.seq, out, bool(pb_utils._families), sends), packer, arena=self._arena)

    def _end(self, message: m.FromStub) -> NoReturn:
        """Answer the server and exit now (no waiting for threads the model left running)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        try:
            wire.send(self.exec, message)
        except OSError:
            pass
        os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pier.backends.python.stub")
    parser.add_argument("--exec-fd", type=int, required=True)
    parser.add_argument("--aux-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=0)  # for `ps`: which server (die_with_parent reads
    # $PIER_PARENT_PID, which pier.ipc sets for every child)
    parser.add_argument("--model", default="")  # for `ps`: which model and instance this is
    parser.add_argument("--instance", default="")
    args = parser.parse_args(argv)
    die_with_parent(oom_score_adj=500)
    faulthandler.enable()  # a segfault prints the model's Python stack to the server's log
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    Stub(socket.socket(fileno=args.exec_fd), socket.socket(fileno=args.aux_fd)).run()


if __name__ == "__main__":
    main()
