"""The stub process of one Python model instance (Triton's `triton_python_backend_stub`): it
loads model.py with the same PythonInstance the in-process mode uses, so pb_utils behaves the
same, and talks to the server over two channels it inherits (server/ipc/channel.py):

- exec: the server sends `init`, then `exec` (a batch of requests) and `finalize`, one at a time;
  this process's main thread answers each (`ready` / `init_error`, `result`, `finalized`);
- aux: everything that crosses while a model runs: responses sent through response senders
  (`send`), BLS requests and model control (`bls`, `mgmt`), cancellation checks (`cancelled?`),
  log records (`log`), and the server's custom-metrics queries (`metrics?`), read here by one
  reader thread.

The process dies with the server: PR_SET_PDEATHSIG (SIGKILL), a parent-pid check after setting
it, and end-of-file on either channel. Its OOM score is raised by 500, so that when a model's
memory grows without bound the kernel kills the stub (restarted) rather than the server. SIGINT
and SIGTERM are ignored (a Ctrl-C or a process-group SIGTERM reaches the server, which drains and
then finalizes its stubs).

Run by the server as `python -m pier.backends.python.stub --exec-fd N --aux-fd M --parent-pid P`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import faulthandler
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NoReturn

from pier.backends.python import triton_python_backend_utils as pb_utils
from pier.backends.python.backend import PythonInstance
from pier.backends.python.bls import BlsClient
from pier.contract.backend import InstanceContext, ModelContext
from pier.contract.errors import PierError, internal
from pier.contract.types import ExecuteResult, InferenceRequest, InferenceResponse, Outputs
from pier.ipc import channel as wire

_PR_SET_PDEATHSIG = 1
Reply = tuple[list[Any], wire.Source]


def _oom_first() -> None:
    """When memory runs out, the kernel should kill a stub (restarted, its model's requests fail) rather
    than the server: raise this process's OOM score (allowed without privileges)."""
    try:
        path = "/proc/self/oom_score_adj"
        with open(path) as fh:
            current = int(fh.read().strip() or 0)
        with open(path, "w") as fh:
            fh.write(str(min(1000, current + 500)))
    except (OSError, ValueError):
        pass


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux: end-of-file still ends it
        pass
    if os.getppid() != parent_pid:  # the server died before prctl took effect
        os._exit(1)


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
        msg, _ = stub.call("cancelled?", self._rid)  # type: ignore[attr-defined]
        self._seen = bool(msg[2])
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
            wire.send(self._stub.aux, ["log", record.levelno, record.name, text])
        except Exception:  # the server is gone or the record cannot be formatted
            pass


class RemoteServices:
    """pier.contract.backend.ServerServices for BlsClient (and so pb_utils) in this process: each
    call is a message to the server, which runs it through its data plane."""

    def __init__(self, stub: Stub) -> None:
        self._stub = stub

    def _request(self, request: InferenceRequest) -> tuple[list[Any], wire.Packer]:
        packer = wire.Packer()
        return wire.request_out(request, packer), packer

    def infer(self, request: InferenceRequest) -> InferenceResponse:
        w, packer = self._request(request)
        msg, mapping = self._stub.call("bls", False, w, packer=packer)
        response = wire.response_in(msg[2], mapping)
        if isinstance(response, PierError):
            raise response
        return response

    def infer_stream(self, request: InferenceRequest) -> Iterator[InferenceResponse | PierError]:
        w, packer = self._request(request)
        items: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        qid = self._stub.open(lambda msg, mapping: items.put((msg, mapping)))
        self._stub.send_call("bls", qid, True, w, packer=packer)
        while True:
            msg, mapping = items.get()
            if msg[0] == "bls_end":
                self._stub.close_call(qid)
                return
            yield wire.response_in(msg[2], mapping)

    async def infer_async(self, request: InferenceRequest) -> InferenceResponse:
        w, packer = self._request(request)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()

        def resolve(reply: Reply) -> None:
            if not fut.done():
                fut.set_result(reply)

        def done(msg: list[Any], mapping: wire.Source) -> None:
            loop.call_soon_threadsafe(resolve, (msg, mapping))

        qid = self._stub.open(done)
        self._stub.send_call("bls", qid, False, w, packer=packer)
        try:
            msg, mapping = await fut
        finally:
            self._stub.close_call(qid)
        response = wire.response_in(msg[2], mapping)
        if isinstance(response, PierError):
            raise response
        return response

    async def infer_stream_async(self, request: InferenceRequest) -> AsyncIterator[InferenceResponse | PierError]:
        w, packer = self._request(request)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Reply] = asyncio.Queue()
        def put(msg: list[Any], mapping: wire.Source) -> None:
            loop.call_soon_threadsafe(items.put_nowait, (msg, mapping))

        qid = self._stub.open(put)
        self._stub.send_call("bls", qid, True, w, packer=packer)
        try:
            while True:
                msg, mapping = await items.get()
                if msg[0] == "bls_end":
                    return
                yield wire.response_in(msg[2], mapping)
        finally:
            self._stub.close_call(qid)

    def _manage(self, op: str, name: str, arg: Any) -> Any:
        msg, _ = self._stub.call("mgmt", op, name, arg)
        if msg[2]:
            raise wire.error_in(msg[3])
        return msg[3]

    def load_model(self, name: str, parameters: dict[str, Any]) -> None:
        self._manage("load", name, parameters)

    def unload_model(self, name: str, parameters: dict[str, Any]) -> None:
        self._manage("unload", name, parameters)

    def model_ready(self, name: str, version: str) -> bool:
        return bool(self._manage("ready", name, version))

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        raise internal("the server's event loop is not reachable from a stub process")


class Stub:
    def __init__(self, exec_sock: socket.socket, aux_sock: socket.socket) -> None:
        self.exec = exec_sock
        self.aux = aux_sock
        self._exec_rx = wire.Receiver(exec_sock)
        self._aux_rx = wire.Receiver(aux_sock)
        self._ids = itertools.count(1)
        self._calls: dict[int, Callable[[list[Any], wire.Source], None]] = {}
        self.instance: PythonInstance | None = None
        self._arena = wire.Arena()  # the results' large tensors

    # ---- calls to the server ---------------------------------------------------------------

    def open(self, handler: Callable[[list[Any], wire.Source], None]) -> int:
        qid = next(self._ids)
        self._calls[qid] = handler
        return qid

    def close_call(self, qid: int) -> None:
        self._calls.pop(qid, None)

    def send_call(self, kind: str, qid: int, *args: Any, packer: wire.Packer | None = None) -> None:
        wire.send(self.aux, [kind, qid, *args], packer)

    def call(self, kind: str, *args: Any, packer: wire.Packer | None = None) -> Reply:
        """Send a message and wait for the server's answer to it (the server answers each)."""
        box: list[Reply] = []
        ready = threading.Event()

        def handler(msg: list[Any], mapping: wire.Source) -> None:
            box.append((msg, mapping))
            ready.set()

        qid = self.open(handler)
        try:
            self.send_call(kind, qid, *args, packer=packer)
            ready.wait()
        finally:
            self.close_call(qid)
        return box[0]

    def _read_aux(self) -> None:
        while True:
            try:
                got = self._aux_rx.recv()
            except OSError:
                got = None
            if got is None:  # the server is gone
                os._exit(0)
            msg, mapping = got
            if msg[0] == "metrics?":
                text = self.instance.prometheus("", "") if self.instance is not None else ""
                try:  # never block this thread on the server: it would not read its answers
                    wire.send(self.aux, ["metrics", msg[1], text], flags=socket.MSG_DONTWAIT)
                except OSError:
                    pass
                continue
            handler = self._calls.get(msg[1])
            if handler is not None:
                handler(msg, mapping)

    # ---- the model ---------------------------------------------------------------------------

    def _sink(self, rid: int, name: str) -> Callable[[Outputs | PierError | None, bool], None]:
        def sink(result: Outputs | PierError | None, final: bool) -> None:
            packer = wire.Packer()
            try:
                w = wire.result_out(result, packer)
            except Exception as exc:
                packer = wire.Packer()
                w = wire.error_out(internal(f"python model '{name}' sent an unusable tensor: {exc}"))
            wire.send(self.aux, ["send", rid, w, final], packer)
        return sink

    def _results(self, results: list[ExecuteResult], name: str) -> tuple[list[Any], wire.Packer]:
        packer = wire.Packer()
        out: list[Any] = []
        for result in results:
            try:
                out.append(wire.result_out(result, packer))
            except Exception as exc:
                out.append(wire.error_out(internal(f"python model '{name}' returned an unusable tensor: {exc}")))
        return out, packer

    def run(self) -> None:
        got = self._exec_rx.recv()
        if got is None:
            os._exit(0)
        init = pickle.loads(got[0][1])
        root = logging.getLogger()
        root.handlers[:] = [_LogForwarder(self)]
        root.setLevel(init["log_level"])
        threading.Thread(target=self._read_aux, name="pier-stub-aux", daemon=True).start()
        services = RemoteServices(self)
        pb_utils._bls = BlsClient(services)  # type: ignore[arg-type]
        ctx = ModelContext(spec=init["spec"], version=init["version"], model_dir=init["model_dir"],
                           version_dir=init["version_dir"], config_json=init["config_json"],
                           services=services)  # type: ignore[arg-type]
        where = InstanceContext(*init["instance"])
        name = ctx.spec.name
        try:
            instance = PythonInstance(ctx, where)
        except PierError as exc:
            self._end(["init_error", *wire.error_out(exc)])
        except BaseException as exc:
            self._end(["init_error", *wire.error_out(internal(f"python model '{name}' failed to load: "
                                                               f"{type(exc).__name__}: {exc}"))])
        self.instance = instance
        wire.send(self.exec, ["ready", bool(pb_utils._families)])
        self._serve(instance, name)

    def _serve(self, instance: PythonInstance, name: str) -> None:
        while True:
            got = self._exec_rx.recv()
            if got is None:  # the server is gone
                os._exit(0)
            msg, mapping = got
            if msg[0] == "finalize":
                instance.close()
                self._end(["finalized"])
            requests = []
            for w in msg[2]:
                rid, request, has_sink = wire.request_in(w, mapping, _RemoteRequest)
                request._stub, request._rid = self, rid  # type: ignore[attr-defined]
                if has_sink:
                    request.response_sink = self._sink(rid, name)
                requests.append(request)
            try:
                results = instance.execute(requests)
            except BaseException as exc:  # PythonInstance catches the model's own exceptions
                results = [internal(f"python model '{name}' failed: {type(exc).__name__}: {exc}")] * len(requests)
            out, packer = self._results(results, name)
            wire.send(self.exec, ["result", msg[1], out, bool(pb_utils._families)], packer, arena=self._arena)

    def _end(self, message: list[Any]) -> NoReturn:
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
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--model", default="")  # for `ps`: which model and instance this is
    parser.add_argument("--instance", default="")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    _oom_first()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.enable()  # a segfault prints the model's Python stack to the server's log
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    Stub(socket.socket(fileno=args.exec_fd), socket.socket(fileno=args.aux_fd)).run()


if __name__ == "__main__":
    main()
