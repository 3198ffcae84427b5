"""gRPC ModelInfer over any InferencePlane: decode (the rate limits first, when this process
applies them), serve, encode. The server's servicer (servicer.py: ModelInfer and the requests of
ModelStreamInfer) and a frontend process's (workers/worker.py) share it."""

from __future__ import annotations

import time
from typing import Any

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest
from pier.dataplane.plane import InferencePlane
from pier.frontends.grpc import codec
from pier.frontends.guards import RateLimiter, limited_message, presented_key
from pier.lifecycle.loaded_model import LoadedModel
from pier.protocol import grpc_service_pb2 as pb
from pier.tensors.validation import forward_headers
from pier.tensors.validation import header_pattern as compile_pattern


def traceparent(metadata: Any) -> str:
    """The W3C traceparent in a call's metadata ("" when none)."""
    for key, value in metadata or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode("latin-1")
    return ""


def rate_limited(model: str, refused: tuple[float, str]) -> PierError:
    """The gRPC error for a request a rate limit refused ((seconds to wait, the limit's scope))."""
    return PierError(ErrorCode.RATE_LIMITED, limited_message(model, refused[1], refused[0]))


class UnaryInfer:
    def __init__(self, plane: InferencePlane, header_pattern: str = "", limiter: RateLimiter | None = None) -> None:
        self.plane = plane
        self.header_pattern = compile_pattern(header_pattern)  # --grpc-header-forward-pattern
        self.limiter = limiter  # None: the rate limits are applied elsewhere (a frontend asks the server)

    def received(self) -> int:
        """The receive stamp of a request (0: not traced)."""
        return time.perf_counter_ns() if self.plane.tracer.on else 0

    def decode(self, request: pb.ModelInferRequest, context: Any) -> InferenceRequest:
        if self.limiter is not None and self.limiter.enabled:  # --rate-limit-model / --rate-limit-key
            key = presented_key(dict(context.invocation_metadata() or ()))
            refused = self.limiter.admit(request.model_name, key)
            if refused is not None:
                raise rate_limited(request.model_name, refused)
        decoded = codec.decode_request(request, self.plane.shared_memory)
        if self.header_pattern is not None:
            forward_headers(self.header_pattern, context.invocation_metadata() or (), decoded.parameters)
        if self.plane.tracer.propagates:  # OpenTelemetry: the caller's trace is this request's parent
            decoded.trace_context = traceparent(context.invocation_metadata())
        return decoded

    async def serve(self, received: int, infer_request: InferenceRequest,
                    model: LoadedModel | None = None) -> pb.ModelInferResponse:
        """One request to a model that is not decoupled. `received`: when the request was read
        (before the handler ran), 0 when not traced."""
        shm = self.plane.shared_memory
        return await self.plane.serve(infer_request, lambda answer: codec.encode_response(answer, infer_request, shm),
                                      model, "GRPC", received)
