"""The v2 infer route below aiohttp's web layer (issue 30).

aiohttp's web framework (its Request and Response objects, router, middleware chain and response
hooks) costs more CPU per request than all of Pier's own work on a small infer (bench/results/
protocol_floor.md). So a connection starts on this protocol: it frames each HTTP/1.1 request
itself (request line, headers, Content-Length body) and serves the plainest one, `POST
/v2/models/{model}[/versions/{version}]/infer` with a Content-Length body, through the same
handler code as the aiohttp route (HttpHandlers.decode_infer, InferHandler.answer) and the same
error texts, headers and statuses (error_middleware's, the response hooks': X-Request-Id,
`Connection: close` while the server drains).

Anything else (another path or method, HTTP/1.0, chunked or compressed bodies, `Expect`,
`Upgrade`, an ORCA load-report header, a header that is not plain ASCII or appears twice, a
debug log that prints request lines) hands the connection to aiohttp at that request's first
byte: aiohttp's own protocol takes the transport and every byte not yet answered, and serves the
rest of the connection as it serves any. A frontend process (pier.frontends.workers.worker) uses
this protocol too; what it must relay to the server after all, which it knows only once the body is
read, its decode_infer answers with HandOver: the request's bytes go back in front of the buffer and
the connection to aiohttp. Answers stay in order (a request is taken from the buffer
only after the one before it was answered), and the socket is not read while the client does not
read what was written or has sent more than _HIGH_WATER bytes ahead."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from aiohttp import web
from aiohttp.compression_utils import ZLibCompressor
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.web_response import CONTENT_CODINGS, ContentCoding

from pier.contract.errors import PierError
from pier.contract.types import InferenceRequest
from pier.frontends.http import codec
from pier.frontends.http.errors import from_error, internal_error
from pier.frontends.http.infer import COMPRESS_MIN_BYTES, InferHandler
from pier.frontends.http.middleware import LOAD_FORMAT, REQUEST_ID, new_request_id
from pier.frontends.http.middleware import log as http_log
from pier.lifecycle.loaded_model import LoadedModel

log = logging.getLogger(__name__)

# The head of a request this protocol serves: the request line of a v2 infer (a model name as
# aiohttp's router passes it on unchanged: no percent-escapes to decode) and header fields of
# token names and printable values (no obs-fold, no control characters).
_HEAD = re.compile(r"POST /v2/models/([A-Za-z0-9_.~\-]+)(?:/versions/([0-9]+))?/infer HTTP/1\.1"
                   r"((?:\r\n[!#$%&'*+.^_`|~0-9A-Za-z\-]+:[\t -~]*)*)")
# A request with one of these goes to aiohttp, which implements them (or refuses them) as usual.
_HANDED_OVER = frozenset({"transfer-encoding", "content-encoding", "expect", "upgrade", LOAD_FORMAT})
_MAX_HEAD = 65536  # a head that is not complete by then is aiohttp's to refuse
_HIGH_WATER = 1 << 18  # bytes read ahead of the request being served (pipelined ones): beyond, reading pauses
_MAX_LINE = 8190  # aiohttp's limit on a request or header line
KEEPALIVE_S = 75.0  # aiohttp's keepalive_timeout: an idle kept-alive connection closes after it


class _Plane(Protocol):
    @property
    def exiting(self) -> bool:  # the server drains: each answer says `Connection: close`
        ...


class HttpHandlers(Protocol):
    """What this protocol uses of app.HttpHandlers (which builds the FastInfer), or of a frontend
    process's handlers (pier.frontends.workers.worker)."""

    @property
    def plane(self) -> _Plane: ...

    @property
    def inference(self) -> InferHandler: ...

    def decode_infer(self, model: str, version: str, body: bytes,
                     json_length: int | None) -> tuple[InferenceRequest, LoadedModel | None]:
        """The request, and its version when decoding resolved it; HandOver: aiohttp's route serves it."""
        ...


class HandOver(Exception):
    """decode_infer's answer for a request that aiohttp's route serves (a frontend process relays
    one that names shared memory, or a raw binary body, to the server): the connection is handed
    to aiohttp from this request on, its bytes put back first."""


class _Headers:
    """A request's header fields, looked up case-insensitively (what aiohttp's request.headers gives the handler)."""

    __slots__ = ("lower", "fields")

    def __init__(self) -> None:
        self.lower: dict[str, str] = {}  # lower-case name -> value (each name once: a repeated one is aiohttp's)
        self.fields: list[tuple[str, str]] = []  # as sent

    def get(self, name: str, /) -> str | None:
        return self.lower.get(name.lower())

    def __getitem__(self, name: str) -> str:
        return self.lower[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self.lower

    def items(self) -> list[tuple[str, str]]:
        return self.fields


def _long_line(head: str) -> bool:
    """A line longer than aiohttp takes (it answers 400)."""
    return any(len(line) > _MAX_LINE for line in head.split("\r\n"))


class _Answer:
    __slots__ = ("status", "reason", "headers", "body")

    def __init__(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status, self.reason, self.headers, self.body = status, reason, headers, body


def _from_response(response: web.Response) -> _Answer:
    body = response.body
    assert isinstance(body, bytes)
    return _Answer(response.status, response.reason, list(response.headers.items()), body)


def _built(payload: bytes, header_len: int | None) -> _Answer:
    if header_len is None:
        return _Answer(200, "OK", [("Content-Type", "application/json")], payload)
    return _Answer(200, "OK", [("Content-Type", "application/octet-stream"),
                               (codec.HEADER_LENGTH, str(header_len))], payload)


class FastInfer:
    """What the connections of one HTTP endpoint share: the handlers, aiohttp's protocol factory
    for the requests handed over, and the open connections (closed when the server stops)."""

    def __init__(self, handlers: HttpHandlers, max_body: int) -> None:
        self.handlers = handlers
        self.max_body = max_body  # aiohttp's client_max_size: a longer body is its to refuse (413)
        self.fallback: Callable[[], asyncio.Protocol] | None = None  # aiohttp's protocol factory (InferSite)
        self.connections: weakref.WeakSet[InferProtocol] = weakref.WeakSet()
        self.stopping = False

    def __call__(self) -> InferProtocol:
        protocol = InferProtocol(self)
        self.connections.add(protocol)
        return protocol

    async def stop(self, app: web.Application | None = None) -> None:
        """The endpoint stops (the app's on_shutdown, in the runner's cleanup after the drain):
        idle connections close now, busy ones after their answer."""
        self.stopping = True
        for connection in list(self.connections):
            connection.close_when_idle()


class InferProtocol(asyncio.Protocol):
    def __init__(self, shared: FastInfer) -> None:
        self.shared = shared
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy: asyncio.Task[None] | None = None  # the request being served
        self.reading = True
        self.writable = True
        self.closing = False
        self.last_active = time.monotonic()
        self.idle_timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.busy is None:
            self._next()
        elif len(self.buffer) > _HIGH_WATER:  # a client that sends on and on while its request runs
            self._pause()

    def eof_received(self) -> None:
        return None  # the transport closes itself, as aiohttp's does

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.busy is not None:  # the client left: its request is cancelled (handler_cancellation)
            self.busy.cancel()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        self.shared.connections.discard(self)

    def pause_writing(self) -> None:  # the client does not read: take no new request meanwhile
        self.writable = False
        self._pause()

    def resume_writing(self) -> None:
        self.writable = True
        if self.busy is None and not self.closing:
            self._next()

    # ---- requests -------------------------------------------------------------------------

    def _pause(self) -> None:
        if self.reading and self.transport is not None and not self.transport.is_closing():
            self.reading = False
            self.transport.pause_reading()

    def _resume(self) -> None:
        if not self.reading and self.transport is not None and not self.transport.is_closing():
            self.reading = True
            self.transport.resume_reading()

    def _next(self) -> None:
        """Serve the next whole request in the buffer, or hand the connection over, or wait for bytes."""
        if self.closing or not self.writable:
            return
        request = self._parse()
        if request is None:
            self._resume()
            return
        if not isinstance(request, tuple):
            self._hand_over()
            return
        if len(self.buffer) <= _HIGH_WATER:
            self._resume()
        self.last_active = time.monotonic()
        self.busy = asyncio.ensure_future(self._serve(*request))

    def _parse(self) -> tuple[str, str, _Headers, bytes, bytes, bool] | bool | None:
        """(model, version, headers, head, body, keep_alive) of the next request when it is whole and
        this protocol serves it; False: aiohttp serves it; None: not all of it is here yet."""
        buffer = self.buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return False if len(buffer) > _MAX_HEAD else None
        try:
            head = buffer[:end].decode("ascii")
        except UnicodeDecodeError:
            return False
        match = _HEAD.fullmatch(head)
        if match is None or http_log.isEnabledFor(logging.DEBUG) or (end > _MAX_LINE and _long_line(head)):
            return False
        headers = _Headers()
        lower, items = headers.lower, headers.fields
        for line in match.group(3).split("\r\n")[1:]:
            name, _, value = line.partition(":")
            key = name.lower()
            if key in lower:
                return False
            lower[key] = value = value.strip(" \t")
            items.append((name, value))
        if not _HANDED_OVER.isdisjoint(lower):
            return False
        length = lower.get("content-length")
        connection = lower.get("connection", "").lower()
        if length is None or not length.isdigit() or connection not in ("", "keep-alive", "close"):
            return False
        size = int(length)
        if size > self.shared.max_body:
            return False  # aiohttp answers 413 in its words
        total = end + 4 + size
        if len(buffer) < total:
            return None
        with memoryview(buffer) as view:
            raw_head, body = bytes(view[:end + 4]), bytes(view[end + 4:total])
        del buffer[:total]
        return match.group(1), match.group(2) or "", headers, raw_head, body, connection != "close"

    def _hand_over(self) -> None:
        """From this request on, aiohttp's protocol serves the connection (every byte not answered)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.shared.connections.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        self.closing = True  # this protocol is done with it
        assert self.shared.fallback is not None, "InferSite sets aiohttp's protocol factory when it starts"
        protocol = self.shared.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        data, self.buffer = bytes(self.buffer), bytearray()
        if not self.reading:
            self.reading = True
            transport.resume_reading()
        if data:
            protocol.data_received(data)

    async def _serve(self, model: str, version: str, headers: _Headers, head: bytes, body: bytes,
                     keep_alive: bool) -> None:
        """One request, answered; `busy` until its answer is written (a stopping endpoint closes
        only idle connections)."""
        try:
            answer = await self._answer(model, version, headers, body)
            if "Accept-Encoding" in headers and len(answer.body) >= COMPRESS_MIN_BYTES:
                answer = await _compressed(answer, headers["Accept-Encoding"].lower())
        except HandOver:
            self.buffer[:0] = head + body  # aiohttp reads the request from its first byte
            self._hand_over()
            return
        finally:
            self.busy = None
        transport = self.transport
        if self.closing or transport is None or transport.is_closing():
            return
        close = not keep_alive or self.shared.handlers.plane.exiting or self.shared.stopping
        self._write(answer, headers.get(REQUEST_ID) or new_request_id(), close)
        if close:
            self.closing = True
            transport.close()
            return
        self.last_active = time.monotonic()
        self._next()

    async def _answer(self, model: str, version: str, headers: _Headers, body: bytes) -> _Answer:
        """What the aiohttp route and its error_middleware answer."""
        handlers = self.shared.handlers
        inference = handlers.inference
        received = inference.received()
        try:
            json_length = inference.json_length(body, headers.get(codec.HEADER_LENGTH))
            infer_request, resolved = handlers.decode_infer(model, version, body, json_length)
            answer: _Answer = await inference.answer(headers, infer_request, received, resolved, _built)
            return answer
        except PierError as exc:
            return _from_response(from_error(exc))
        except HandOver:
            raise
        except Exception as exc:  # never let a bug turn into a dropped connection
            log.exception("unhandled error on POST %s (%s %s)", _path(model, version), REQUEST_ID,
                          headers.get(REQUEST_ID))
            return _from_response(internal_error(exc))

    def _write(self, answer: _Answer, request_id: str, close: bool) -> None:
        lines = [f"HTTP/1.1 {answer.status} {answer.reason}"]
        lines += [f"{name}: {value}" for name, value in answer.headers]
        lines.append(f"{REQUEST_ID}: {request_id}")
        lines.append(f"Content-Length: {len(answer.body)}")
        lines.append(f"Date: {rfc822_formatted_time()}")
        lines.append(f"Server: {SERVER_SOFTWARE}")
        if close:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        assert self.transport is not None
        if len(answer.body) < 65536:
            self.transport.write(head + answer.body)
        else:
            self.transport.writelines((head, answer.body))

    # ---- idle connections -------------------------------------------------------------------

    def close_when_idle(self) -> None:
        if self.busy is None and self.transport is not None and not self.closing:
            self.closing = True
            self.transport.close()

    def _arm_idle_timer(self) -> None:
        delay = self.last_active + KEEPALIVE_S - time.monotonic()
        self.idle_timer = asyncio.get_running_loop().call_later(max(delay, 0.0), self._idle_check)

    def _idle_check(self) -> None:
        self.idle_timer = None
        if self.closing:
            return
        if self.busy is not None:  # a long request: look again a keep-alive period after it began
            self.last_active = time.monotonic()
        elif time.monotonic() - self.last_active >= KEEPALIVE_S:
            self.close_when_idle()
            return
        self._arm_idle_timer()


def _path(model: str, version: str) -> str:
    return f"/v2/models/{model}{'/versions/' + version if version else ''}/infer"


async def _compressed(answer: _Answer, accepted: str) -> _Answer:
    """The answer compressed as aiohttp compresses a whole body the client accepts compressed."""
    for token, coding in CONTENT_CODINGS.items():  # aiohttp's own choice: the first it finds accepted
        if token in accepted:
            if coding is ContentCoding.identity:
                return answer
            compressor = ZLibCompressor(encoding=token)
            body = await compressor.compress(answer.body) + compressor.flush()
            return _Answer(answer.status, answer.reason, [*answer.headers, ("Content-Encoding", token)], body)
    return answer


# build_app leaves its FastInfer here when the route may be served below aiohttp
FAST_INFER = web.AppKey("pier.fast_infer", FastInfer)


def install(app: web.Application, handlers: HttpHandlers) -> None:
    fast = app[FAST_INFER] = FastInfer(handlers, app._client_max_size)
    app.on_shutdown.append(fast.stop)


class InferSite(web.TCPSite):
    """A TCP site whose connections start on InferProtocol (aiohttp's protocol takes over what it
    does not serve); the fast connections close when the app shuts down, as aiohttp's do."""

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        app = getattr(self._runner, "app", None)
        assert isinstance(app, web.Application)
        fast = app[FAST_INFER]
        fast.fallback = server
        self._server = await asyncio.get_running_loop().create_server(
            fast, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
