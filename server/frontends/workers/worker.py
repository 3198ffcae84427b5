"""A frontend process (`--frontend-processes N`): accepts HTTP and gRPC connections on the
server's ports (SO_REUSEPORT: the kernel spreads connections over the N processes) and serves the
v2 tensor paths itself: `POST /v2/models/{model}[/versions/{version}]/infer` and gRPC ModelInfer.
It parses and decodes them with the same codecs and handlers as the server (http/infer.py,
grpc/infer.py, over `RemotePlane`: the server's DataPlane at the other end of its channel,
channel.py), and encodes the answer. Everything else is relayed whole to the server (proxy.py).

Which of the two is decided before anything is decoded: from the request line (the route) and
the headers (a compressed body, a raw binary one, which needs the model's signature), and, on
those paths, from the inference header itself (the HTTP JSON header, parsed once, or the gRPC
message), which says whether a tensor is in shared memory (the server holds the regions).

    python -m pier.frontends.workers.worker FD INDEX

FD is this process's end of its channel; the settings arrive as the first message. The process
dies with the server (pier.ipc.processes.die_with_parent), ignores SIGINT and SIGTERM (the server
drains and stops its frontends itself: when it drains, a frontend closes its listeners), and
exits when the server tells it to, or when the channel closes.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import msgspec
from aiohttp import web

from pier.contract.errors import ErrorCode, PierError, unavailable
from pier.contract.types import InferenceRequest, InferenceResponse
from pier.frontends import restrictions
from pier.frontends.grpc import codec as grpc_codec
from pier.frontends.grpc.infer import UnaryInfer, rate_limited
from pier.frontends.grpc.servicer import _lenient, _translate, bind_and_start, grpc_server
from pier.frontends.guards import ApiKeys, RateLimiter, presented_key
from pier.frontends.http import codec as http_codec
from pier.frontends.http import fastpath
from pier.frontends.http.app import MAX_BODY_BYTES, Handler, close_when_exiting
from pier.frontends.http.infer import InferHandler, web_reply
from pier.frontends.http.middleware import (
    LOAD_FORMAT,
    error_middleware,
    gateway_headers,
    guard_middleware,
    limited_response,
    quiet_client_mistakes,
    restrict_middleware,
)
from pier.frontends.workers import channel as ch
from pier.frontends.workers import messages as fm
from pier.frontends.workers.proxy import GrpcForwarder, HttpProxy
from pier.ipc import channel as wire
from pier.ipc.messages import BadMessage
from pier.ipc.processes import die_with_parent
from pier.observability import log_settings
from pier.observability.tracing import parse_trace_config
from pier.protocol import grpc_service_pb2 as pb
from pier.protocol import health_pb2
from pier.settings import Settings
from pier.tensors.validation import header_pattern as compile_pattern

log = logging.getLogger("pier.frontends")
T = TypeVar("T")

class _Traced:
    on = True  # stamp each request's receive time: the server decides whether it is traced
    propagates = False  # hand on the caller's traceparent: set from the settings (OpenTelemetry mode)


class RemotePlane:
    """The InferencePlane of a frontend process (pier.dataplane.plane.InferencePlane): `serve`
    runs a decoded request through the server's DataPlane, over the channel. It has no shared
    memory (the regions are the server's): a request that names one never reaches it."""

    shared_memory = None

    def __init__(self) -> None:
        self.channel: ch.Channel | None = None
        self.exiting = False
        self.tracer = _Traced()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}

    async def _ask(self, message: fm.Admit | fm.Infer, packer: wire.Packer | None = None) -> Any:
        """Send `message` and wait for the server's answer to it (to its `rid`); a cancelled wait
        tells the server (Cancel), which cancels what it started."""
        if self.channel is None or self.channel.closed:
            raise unavailable("the server process is gone")
        rid = message.rid
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future

        def failed(exc: OSError) -> None:  # it waited in the backlog and could not be sent
            if self._pending.pop(rid, None) is not None and not future.done():
                future.set_exception(PierError(ErrorCode.INTERNAL, f"cannot send the request to the server: {exc}"))

        try:
            self.channel.send(message, packer, failed)
        except (TypeError, msgspec.EncodeError) as exc:  # a BYTES element that is neither bytes nor str
            self._pending.pop(rid, None)
            raise PierError(ErrorCode.INVALID_ARG, f"cannot send this request to the server: {exc}") from exc
        except BaseException:
            self._pending.pop(rid, None)
            raise
        try:
            return await future
        except asyncio.CancelledError:
            if self._pending.pop(rid, None) is not None and not self.channel.closed:
                self.channel.send(fm.Cancel(rid))
            raise

    async def admit(self, model: str, key: str | None) -> tuple[float, str] | None:
        """The server's rate limits (they count every frontend's requests), asked before this
        process reads the request's body: None, or (seconds to wait, the limit's scope)."""
        refused: tuple[float, str] | None = await self._ask(fm.Admit(next(self._ids), model, key))
        return refused

    def refund(self, model: str, key: str | None) -> None:
        """An admitted request goes to the server whole after all, where it is admitted again."""
        if self.channel is not None:
            self.channel.send(fm.Refund(model, key))

    async def serve(self, request: InferenceRequest, encode: Callable[[InferenceResponse], T],
                    model: object = None, protocol: str = "", received_ns: int = 0) -> T:
        packer = wire.Packer()
        wired = wire.request_out(request, packer)
        response: InferenceResponse = await self._ask(fm.Infer(next(self._ids), protocol, received_ns, wired),
                                                      packer)
        return encode(response)

    def answer(self, message: fm.Admitted | fm.Reply, mapping: wire.Source) -> None:
        future = self._pending.pop(message.rid, None)
        if future is None or future.done():  # cancelled meanwhile
            return
        if isinstance(message, fm.Admitted):
            future.set_result(message.refused)
            return
        try:
            reply = wire.response_in(message.response, mapping)
        except Exception as exc:  # a reply this process cannot read: its request fails, not the channel
            reply = PierError(ErrorCode.INTERNAL, f"unreadable answer from the server process: {exc}")
        if isinstance(reply, PierError):
            future.set_exception(reply)
        else:
            future.set_result(reply)

    def unreadable(self, exc: BadMessage) -> None:
        """A message from the server that does not decode: the request it answers fails with why."""
        log.error("frontend process: %s", exc)
        future = self._pending.pop(exc.ref, None) if isinstance(exc.ref, int) else None
        if future is not None and not future.done():
            future.set_exception(PierError(ErrorCode.INTERNAL, f"unreadable answer from the server process: {exc}"))

    def fail_all(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(unavailable("the server process is gone"))
        self._pending.clear()


def _around(handler: Handler, middlewares: list[Any]) -> Handler:
    """`handler` inside `middlewares` (the first one outermost), composed once, when the app is built."""
    for middleware in reversed(middlewares):
        handler = functools.partial(middleware, handler=handler)
    return handler


class _FastHandlers:
    """fastpath.HttpHandlers of a frontend process: an infer decoded as `infer_here` decodes it;
    what `infer` relays to the server (a raw binary body, a request that names shared memory) is
    handed to aiohttp's route, which relays it."""

    def __init__(self, plane: RemotePlane, inference: InferHandler) -> None:
        self.plane, self.inference = plane, inference

    def decode_infer(self, model: str, version: str, body: bytes,
                     json_length: int | None) -> tuple[InferenceRequest, None]:
        infer_request = None if json_length == 0 else _decoded_here(model, version, body, json_length)
        if infer_request is None:
            raise fastpath.HandOver
        return infer_request, None


def _decoded_here(model: str, version: str, body: bytes, json_length: int | None) -> InferenceRequest | None:
    """The infer request a body makes, decoded here; None when its JSON header puts a tensor in
    shared memory: the regions are the server's, so the request is relayed to it."""
    doc, blobs = http_codec.parse_infer_body(body, json_length)
    if http_codec.names_shared_memory(doc):
        return None
    return http_codec.decode_parsed(model, version, doc, blobs)


def build_http_app(plane: RemotePlane, settings: Settings, proxy: HttpProxy) -> web.Application:
    """The v2 infer routes, served here inside the guards' stack (restricted APIs, API keys: the
    rate limits are the server's, asked with `admit`), composed once; every other request, and an
    infer request decided for the server, relayed whole, meeting the guards in the server. Every
    answer, relayed or not, passes error_middleware (a relay that fails is answered as an error)."""
    keys = ApiKeys(settings.api_keys)
    limited = bool(settings.rate_limit_model or settings.rate_limit_key)
    stack: list[Any] = []
    rules = restrictions.parse(settings.http_restricted_api, "--http-restricted-api")
    if rules:
        stack.append(restrict_middleware(rules))
    if keys.enabled:  # keys only: the server applies the rate limits (they count every frontend's requests)
        stack.append(guard_middleware(keys, RateLimiter()))
    h = InferHandler(plane, settings.http_max_input_size, compile_pattern(settings.http_header_forward_pattern))

    async def infer_here(request: web.Request) -> web.StreamResponse:
        model, key = request.match_info["model"], presented_key(request.headers) if limited else None
        if limited:  # before the body is read, as with one process
            refused = await plane.admit(model, key)
            if refused is not None:
                return limited_response(request.path, model, *refused)
        received = h.received()
        body, json_length = await h.read(request)
        infer_request = _decoded_here(model, request.match_info.get("version", ""), body, json_length)
        if infer_request is None:  # the regions are the server's: it serves this one
            if limited:
                plane.refund(model, key)
            return await proxy(request, body)
        return await h.answer(request.headers, infer_request, received, None, web_reply(request.headers))

    served = _around(infer_here, stack)

    async def infer(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity" \
                or http_codec.is_raw_binary(request.headers) or LOAD_FORMAT in request.headers:
            # compressed: inflated (within its limit) by the server; raw binary: decoded against the
            # model's signature, which the server holds; a load report: the server knows the load
            return await proxy(request)
        return await served(request)

    app = web.Application(middlewares=[error_middleware],
                          client_max_size=max(settings.http_max_input_size, MAX_BODY_BYTES))
    close_when_exiting(app, plane)
    gateway_headers(app, None)  # X-Request-Id; the load report comes from the server (relayed)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version:[0-9]+}"):
        app.router.add_post(base + "/infer", infer)
    app.router.add_route("*", "/{tail:.*}", proxy)
    if not stack and not limited:  # no guard to pass: the plain infers are served below aiohttp
        fastpath.install(app, _FastHandlers(plane, h))
    return app


class FrontendServicer:
    """ModelInfer decoded and encoded here (over the RemotePlane); one that puts a tensor in shared
    memory is relayed whole, decided before it is decoded (and before the server's rate limits
    are asked: the server counts it)."""

    def __init__(self, plane: RemotePlane, header_pattern: str, limited: bool, forwarder: GrpcForwarder) -> None:
        self._remote = plane
        self._unary = UnaryInfer(plane, header_pattern)
        self._limited = limited
        self._forwarder = forwarder

    @_translate
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        received = self._unary.received()
        if grpc_codec.names_shared_memory(request):
            answer = await self._forwarder.unary("/inference.GRPCInferenceService/ModelInfer",
                                                 request.SerializeToString(), context)
            return pb.ModelInferResponse.FromString(answer)
        if self._limited:
            key = presented_key(dict(context.invocation_metadata() or ()))
            refused = await self._remote.admit(request.model_name, key)
            if refused is not None:
                raise rate_limited(request.model_name, refused)
        return await self._unary.serve(received, self._unary.decode(request, context))


def add_grpc_services(server: grpc.aio.Server, servicer: FrontendServicer, forwarder: GrpcForwarder) -> None:
    for service in (pb.DESCRIPTOR.services_by_name["GRPCInferenceService"],
                    health_pb2.DESCRIPTOR.services_by_name["Health"]):
        handlers = {}
        for m in service.methods:
            if service.name == "GRPCInferenceService" and m.name == "ModelInfer":
                handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                    servicer.ModelInfer, request_deserializer=_lenient(pb.ModelInferRequest.FromString),
                    response_serializer=pb.ModelInferResponse.SerializeToString)
            else:
                handlers[m.name] = forwarder.handler(f"/{service.full_name}/{m.name}", m.client_streaming,
                                                     m.server_streaming)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
        server.add_registered_method_handlers(service.full_name, handlers)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class Frontend:
    def __init__(self, sock: socket.socket, index: int) -> None:
        self.index = index
        self.plane = RemotePlane()
        self._sock = sock
        self._settings: asyncio.Future[fm.Start] | None = None
        self._stop = asyncio.Event()
        self._draining = asyncio.Event()  # the server drains (or stops): close the listeners
        self._log: dict[str, Any] | None = None  # the server's log settings, until ours are installed
        self._log_installed = False

    def _message(self, message: fm.ToFrontend, mapping: wire.Source) -> None:
        if isinstance(message, (fm.Reply, fm.Admitted)):
            self.plane.answer(message, mapping)
        elif isinstance(message, fm.Exiting):
            self.plane.exiting = True
            self._draining.set()
        elif isinstance(message, fm.Stop):
            self._draining.set()
            self._stop.set()
        elif isinstance(message, fm.LogSettings):
            if self._log_installed:  # follow the server's
                log_settings.update({k: v for k, v in message.settings.items() if k != "log_file"})
            else:
                self._log = message.settings
        elif isinstance(message, fm.Start) and self._settings is not None and not self._settings.done():
            self._settings.set_result(message)

    def _closed(self) -> None:
        self.plane.fail_all()
        self._draining.set()
        self._stop.set()
        if self._settings is not None and not self._settings.done():
            self._settings.set_exception(ConnectionError("the server closed the channel"))

    async def run(self) -> int:
        self._settings = asyncio.get_running_loop().create_future()
        channel = self.plane.channel = ch.Channel(self._sock, self._message, self._closed, fm.TO_FRONTEND,
                                                  self.plane.unreadable)
        start = await self._settings
        settings, paths = start.settings, start.paths
        log_settings.install(log_settings.LogSettings(
            log_file=settings.log_file, log_info=settings.log_info, log_warning=settings.log_warning,
            log_error=settings.log_error, log_verbose_level=settings.log_verbose, log_format=settings.log_format))
        quiet_client_mistakes()
        self.plane.tracer.propagates = parse_trace_config(list(settings.trace_config)).get("trace_mode") \
            == "opentelemetry"
        if self._log is not None:
            log_settings.update({k: v for k, v in self._log.items() if k != "log_file"})
        self._log_installed = True
        runner = proxy = forwarder = server = site = None
        try:
            if settings.allow_http:
                proxy = HttpProxy(paths["http"])
                await proxy.start()
                # auto_decompress off: a compressed body goes to the server as it came (it inflates
                # it only up to --http-max-input-size: a gzip bomb must not inflate here).
                runner = web.AppRunner(build_http_app(self.plane, settings, proxy), access_log=None,
                                       handle_signals=False, handler_cancellation=True, auto_decompress=False)
                await runner.setup()
                site_type = fastpath.InferSite if fastpath.FAST_INFER in runner.app else web.TCPSite
                site = site_type(runner, settings.http_address, settings.http_port, reuse_address=True,
                                 reuse_port=True)
                await site.start()
            if settings.allow_grpc:
                forwarder = GrpcForwarder(paths["grpc"], settings.grpc_max_message_size)
                server = grpc_server(settings.grpc_max_message_size, settings.grpc_options, True,
                                     restrictions.parse(settings.grpc_restricted_protocol,
                                                        "--grpc-restricted-protocol"),
                                     ApiKeys(settings.api_keys))
                limited = bool(settings.rate_limit_model or settings.rate_limit_key)
                add_grpc_services(server, FrontendServicer(self.plane, settings.grpc_header_forward_pattern, limited,
                                                           forwarder), forwarder)
                try:
                    await bind_and_start(server, f"{_host(settings.grpc_address)}:{settings.grpc_port}",
                                         settings.grpc_ssl)
                except RuntimeError as exc:
                    raise OSError(f"cannot bind gRPC to {settings.grpc_address}:{settings.grpc_port}: {exc}") from exc
        except (OSError, PierError) as exc:
            channel.send(fm.Failed(str(exc)))
            await asyncio.sleep(0.1)  # let the message go before the channel closes
            return 1
        channel.send(fm.Ready())
        await self._draining.wait()
        # The server drains, as it does in one process (pier.app): new connections are refused (the
        # listeners close), those open are still served (Connection: close; gRPC: GOAWAY).
        if site is not None:
            await site.stop()
        closing = asyncio.ensure_future(server.stop(settings.exit_timeout_secs)) if server is not None else None
        await self._stop.wait()
        # The server has drained: finish what is still open here, then close.
        if server is not None and closing is not None:
            await server.stop(grace=1.0)
            await closing
        if runner is not None:
            await runner.cleanup()
        for part in (proxy, forwarder):
            if part is not None:
                await part.close()
        channel.close()
        return 0


def main(argv: list[str]) -> int:
    fd, index = int(argv[1]), int(argv[2])
    die_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    sock = socket.socket(fileno=fd)
    return asyncio.run(Frontend(sock, index).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
