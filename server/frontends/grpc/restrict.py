"""gRPC side of `--grpc-restricted-protocol` (pier/restrictions.py parses the rules): a method of a
restricted category answers UNAVAILABLE unless the call carries the header, as Triton 2.51."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pier.frontends.restrictions import Rules

GRPC_HEADER_PREFIX = "triton-grpc-protocol-"

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
