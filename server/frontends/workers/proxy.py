"""What a frontend process does not serve itself goes to the server process whole: HTTP requests
over a Unix socket to the server's own aiohttp app, gRPC calls over a Unix socket to its own
grpc.aio server. The server answers them with the very code that answers them with one process
(the repository API, model control, statistics, metadata, settings, shared memory, streams, the
OpenAI API), so the two modes cannot drift apart; the frontend only relays bytes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

log = logging.getLogger("pier.frontends")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones each side computes for its own connection.
_REQUEST_SKIP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect",
                           "transfer-encoding"})
_RESPONSE_SKIP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade",
                            "transfer-encoding", "content-length", "date", "server"})
_STREAM_CHUNK = 1 << 16


class HttpProxy:
    """Relays a request to the server's HTTP app on `path` (a Unix socket) and its answer back,
    streamed (server-sent events go out as the server writes them). A client that goes away
    cancels the handler, which closes the upstream connection: the server's handler is
    cancelled in turn, as it would be for the client itself."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # limit=0: as many upstream connections as clients (a stream holds one for its whole life);
        # no cookie jar: one session relays every client's requests, a cookie must not pass between them
        self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(self._path, limit=0),
                                              cookie_jar=aiohttp.DummyCookieJar(),
                                              auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None),
                                              skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __call__(self, request: web.Request, body: bytes | None = None) -> web.StreamResponse:
        """`body`: the request body when a handler has read it already."""
        assert self._session is not None
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _REQUEST_SKIP)
        data: Any = None
        if body is not None:
            data = body
            headers.pop("Content-Length", None)
        elif request.body_exists:
            data = request.content.iter_any()
        url = URL("http://pier" + request.raw_path, encoded=True)
        async with self._session.request(request.method, url, headers=headers, data=data,
                                         allow_redirects=False, compress=None) as upstream:
            out = CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_SKIP)
            if request.method == "HEAD":  # no body to count: the length is the server's for GET
                if "Content-Length" in upstream.headers:
                    out["Content-Length"] = upstream.headers["Content-Length"]
                return web.Response(status=upstream.status, reason=upstream.reason, headers=out)
            if upstream.content_length is not None and "text/event-stream" not in upstream.content_type:
                return web.Response(status=upstream.status, reason=upstream.reason, body=await upstream.read(),
                                    headers=out)
            reply = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=out)
            await reply.prepare(request)
            async for chunk in upstream.content.iter_any():
                await reply.write(chunk)
            await reply.write_eof()
            return reply


# ---- gRPC -----------------------------------------------------------------------------------

def _metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, Any], ...]:
    """The client's metadata, less what grpc sets itself on the upstream call."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if not k.startswith((":", "grpc-")) and k != "user-agent")


async def _abort(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> None:
    trailing = exc.trailing_metadata()
    if trailing:
        context.set_trailing_metadata(tuple((k, v) for k, v in trailing if not k.startswith("grpc-")))
    await context.abort(exc.code(), exc.details() or "")


class GrpcForwarder:
    """Handlers that relay one gRPC method's raw messages to the server's grpc.aio server."""

    def __init__(self, path: str, max_message_bytes: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"unix:{path}", options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ])

    async def close(self) -> None:
        await self.channel.close()

    async def unary(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            answer: bytes = await self.channel.unary_unary(method)(request, metadata=_metadata(context),
                                                                   timeout=context.time_remaining())
            return answer
        except grpc.aio.AioRpcError as exc:
            await _abort(context, exc)
            raise  # pragma: no cover - abort raised

    def handler(self, method: str, client_streaming: bool, server_streaming: bool) -> grpc.RpcMethodHandler:
        if not client_streaming and not server_streaming:
            async def unary_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                return await self.unary(method, request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary)

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            metadata, timeout = _metadata(context), context.time_remaining()
            pump = None
            if client_streaming:
                call: Any = self.channel.stream_stream(method)(metadata=metadata, timeout=timeout)

                async def forward() -> None:
                    async for message in request:
                        await call.write(message)
                    await call.done_writing()
                pump = asyncio.ensure_future(forward())
            else:
                call = self.channel.unary_stream(method)(request, metadata=metadata, timeout=timeout)
            try:
                async for reply in call:
                    yield reply
            except grpc.aio.AioRpcError as exc:
                await _abort(context, exc)
            finally:
                if pump is not None:
                    pump.cancel()
                    # its error (the client's stream broke) is the call's: retrieved, not logged as lost
                    pump.add_done_callback(lambda t: t.cancelled() or t.exception())
                call.cancel()

        if client_streaming and server_streaming:
            return grpc.stream_stream_rpc_method_handler(streaming)
        if server_streaming:
            return grpc.unary_stream_rpc_method_handler(streaming)
        raise ValueError(f"{method}: client-streaming methods with one answer are not relayed (none exist)")
