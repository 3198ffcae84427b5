"""`POST /v2/models/{model}[/versions/{version}]/infer` over any InferencePlane: read and check
the body, then, once decoded, serve the request and encode the answer (JSON, or binary tensors
with Inference-Header-Content-Length). The server's handler (app.py) and a frontend process's
(workers/worker.py) share it; what each decodes differs (the server also takes raw binary bodies
and shared memory, which need its state)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from aiohttp import web

from pier.contract.types import InferenceRequest, InferenceResponse
from pier.dataplane.plane import InferencePlane
from pier.frontends.http import codec
from pier.lifecycle.loaded_model import LoadedModel
from pier.tensors.validation import HeaderPattern, forward_headers

# Smaller answers go out uncompressed even when the client accepts gzip (HTTP allows it): most
# clients (requests, aiohttp) always send Accept-Encoding, and compressing a few hundred bytes
# costs more time than it saves.
COMPRESS_MIN_BYTES = 1024
T = TypeVar("T")
Build = Callable[[bytes, "int | None"], T]  # the answer's payload and its JSON header's length -> what is sent


class Headers(Protocol):
    """A request's header fields as the handler reads them (aiohttp's request.headers, or fastpath's)."""

    def get(self, name: str, /) -> str | None: ...

    def items(self) -> Iterable[tuple[str, str]]: ...

    def __contains__(self, name: object, /) -> bool: ...


def web_reply(headers: Headers) -> Build[web.Response]:
    """Answers as aiohttp responses (it writes them after the handler returns)."""
    compress = "Accept-Encoding" in headers

    def build(payload: bytes, header_len: int | None) -> web.Response:
        if header_len is None:
            out = web.Response(body=payload, content_type="application/json")
        else:
            out = web.Response(body=payload, content_type="application/octet-stream",
                               headers={codec.HEADER_LENGTH: str(header_len)})
        if compress and len(payload) >= COMPRESS_MIN_BYTES:
            out.enable_compression()  # gzip or deflate, as the client accepts
        return out

    return build


class InferHandler:
    def __init__(self, plane: InferencePlane, max_json_size: int, header_pattern: HeaderPattern | None = None) -> None:
        self.plane = plane
        self.max_json_size = max_json_size
        self.header_pattern = header_pattern  # --http-header-forward-pattern

    @staticmethod
    def received() -> int:
        """The receive stamp of a request (its trace's HTTP_RECV)."""
        return time.perf_counter_ns()

    async def read(self, request: web.Request) -> tuple[bytes, int | None]:
        """The body and its JSON header's length (None: all JSON; 0: raw binary), both checked."""
        body = await codec.read_body(request, self.max_json_size, json_only=codec.HEADER_LENGTH not in request.headers)
        return body, self.json_length(body, request.headers.get(codec.HEADER_LENGTH))

    def json_length(self, body: bytes, header: str | None) -> int | None:
        """The JSON header's length a whole `body` declares (`header`: its Inference-Header-Content-Length), checked."""
        json_length = codec.header_length(header, len(body))
        codec.check_json_size(len(body) if json_length is None else json_length, self.max_json_size)
        return json_length

    async def answer(self, headers: Headers, infer_request: InferenceRequest, received: int,
                     resolved: LoadedModel | None, build: Build[T]) -> T:
        """Serve `infer_request` (`resolved`: the version it runs on, when decoding needed it);
        `build` makes what is sent of the encoded answer."""
        forward_headers(self.header_pattern, headers.items(), infer_request.parameters)
        if self.plane.tracer.propagates:  # OpenTelemetry: the caller's trace is this request's parent
            infer_request.trace_context = headers.get("traceparent") or ""
        shm = self.plane.shared_memory

        def reply(response: InferenceResponse) -> T:
            return build(*codec.encode_response(response, infer_request, shm))

        return await self.plane.serve(infer_request, reply, resolved, "HTTP", received)
