"""tritonserver's `--http-restricted-api` / `--grpc-restricted-protocol`: API categories that answer
only requests carrying a given header (an admin key in front of model control, say).

`CATEGORIES[,CATEGORY...]:KEY=VALUE`, repeatable, each category restricted at most once. Refused
requests get Triton 2.51's answers (probed): HTTP 403 `This API is restricted, expecting header
'KEY'`; gRPC UNAVAILABLE `This protocol is restricted, expecting header 'triton-grpc-protocol-KEY'`
(gRPC clients send the key with that prefix, as Triton expects).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from aiohttp import web

CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"

Rules = dict[str, tuple[str, str]]  # category -> (header key, expected value)


def parse(specs: Sequence[str], flag: str) -> Rules:
    """The rules of every `flag` value; ValueError names the problem."""
    rules: Rules = {}
    for spec in specs:
        categories, sep, header = spec.partition(":")
        key, eq, value = header.partition("=")
        if not sep or not eq or not key or not value or not categories:
            raise ValueError(f"{flag}={spec}: expected CATEGORY[,CATEGORY...]:KEY=VALUE")
        for category in categories.split(","):
            if category not in CATEGORIES:
                raise ValueError(f"{flag}: unknown restricted category '{category}' (one of {', '.join(CATEGORIES)})")
            if category in rules:
                raise ValueError(f"{flag}: category '{category}' is restricted more than once")
            rules[category] = (key, value)
    return rules


def http_category(path: str) -> str | None:
    """The API category of an HTTP path (Triton's grouping; Pier's OpenAI routes count as inference)."""
    if path.startswith("/v1/"):
        return "inference"
    if path.startswith("/v2/health/"):
        return "health"
    if path.startswith("/v2/repository/"):
        return "model-repository"
    if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
        return "shared-memory"
    if path.startswith("/v2/logging"):
        return "logging"
    tail = path.rstrip("/").rsplit("/", 1)[-1]
    if path.endswith("/trace/setting"):
        return "trace"
    return {"stats": "statistics", "config": "model-config", "ready": "health", "infer": "inference",
            "generate": "inference", "generate_stream": "inference"}.get(tail, "metadata" if path.startswith("/v2")
                                                                               else None)


def http_middleware(rules: Rules) -> Callable[..., Awaitable[web.StreamResponse]]:
    from pier.frontends.http.app import error_response  # the one JSON error shape

    @web.middleware
    async def restrict(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
        rule = rules.get(http_category(request.path) or "")
        # Only real routes are restricted: an unknown path stays a 404, as in Triton.
        if rule is not None and request.match_info.http_exception is None and request.headers.get(rule[0]) != rule[1]:
            return error_response(403, f"This API is restricted, expecting header '{rule[0]}'")
        return await handler(request)

    return restrict


_GRPC_CATEGORIES = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health", "Check": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "ModelConfig": "model-config", "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository", "RepositoryModelUnload": "model-repository",
    "ModelStatistics": "statistics", "TraceSetting": "trace", "LogSettings": "logging",
}


class GrpcRestrictions(grpc.aio.ServerInterceptor):
    def __init__(self, rules: Rules) -> None:
        self._rules = {c: (GRPC_HEADER_PREFIX + k.lower(), v) for c, (k, v) in rules.items()}

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        rule = self._rules.get(_GRPC_CATEGORIES.get(method, ""))
        if rule is None or dict(details.invocation_metadata or ()).get(rule[0]) == rule[1]:
            return await continuation(details)
        message = f"This protocol is restricted, expecting header '{rule[0]}'"

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        if method == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
