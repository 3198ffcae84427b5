"""gRPC side of --api-key (pier/guards.py): every method but the health checks needs the key in the
call's metadata (`authorization: Bearer KEY` or `api-key: KEY`), else UNAUTHENTICATED."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pier.frontends.guards import ApiKeys, presented_key

_OPEN = frozenset({"ServerLive", "ServerReady", "Check", "Watch"})  # inference.* health and grpc.health.v1


class GrpcApiKeys(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        key = presented_key(dict(details.invocation_metadata or ()))
        if method in _OPEN or self._keys.allows(key):
            return await continuation(details)
        message = "Incorrect API key provided." if key is not None else \
            "no API key: send metadata 'authorization: Bearer KEY' (or 'api-key: KEY')"

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if method == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
