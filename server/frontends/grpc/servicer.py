"""GRPCInferenceService and grpc.health.v1: each RPC converts, calls the DataPlane, converts
back. PierError becomes a gRPC status through one table (errors.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from server.control_plane import ControlPlane
from server.data_plane import DataPlane
from server.errors import PierError, unsupported
from server.frontends.grpc import codec
from server.frontends.grpc.errors import grpc_code
from server.protocol import grpc_service_pb2 as pb
from server.protocol import grpc_service_pb2_grpc as pb_grpc
from server.protocol import health_pb2, health_pb2_grpc

log = logging.getLogger("pier.grpc")


def _translate(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except PierError as exc:
            await context.abort(grpc_code(exc.code), exc.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            log.exception("unhandled error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
    return wrapper


def _not_yet(rpc: str) -> Callable[..., Any]:
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise unsupported(f"{rpc} is not implemented by this server yet")
    return _translate(handler)


def _check_repository(name: str) -> None:
    if name:
        raise unsupported(f"named repositories ('{name}') are not supported: leave repository_name empty")


def _repository_parameters(params: Any) -> dict[str, Any]:
    """ModelRepositoryParameter oneofs -> plain values (file contents stay bytes)."""
    out: dict[str, Any] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which else None
    return out


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane, control: ControlPlane) -> None:
        self.plane = plane
        self.control = control

    @_translate
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.plane.live())

    @_translate
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.plane.ready())

    @_translate
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        # Triton 2.51 answers OK + ready=false for unknown models and versions (not an error).
        try:
            ready = self.plane.model_ready(request.name, request.version)
        except PierError:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    @_translate
    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return json_format.ParseDict(self.plane.server_metadata(), pb.ServerMetadataResponse())

    @_translate
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        doc = self.plane.model_metadata(request.name, request.version)
        return json_format.ParseDict(doc, pb.ModelMetadataResponse())

    @_translate
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self.plane.model_config(request.name, request.version))

    @_translate
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        stats = self.plane.statistics(request.name, request.version)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    @_translate
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        rows = self.control.index(request.ready)
        return json_format.ParseDict({"models": rows}, pb.RepositoryIndexResponse())

    @_translate
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Any) -> pb.RepositoryModelLoadResponse:
        _check_repository(request.repository_name)
        await self.control.load(request.model_name, _repository_parameters(request.parameters))
        return pb.RepositoryModelLoadResponse()

    @_translate
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Any) -> pb.RepositoryModelUnloadResponse:
        _check_repository(request.repository_name)
        await self.control.unload(request.model_name, _repository_parameters(request.parameters))
        return pb.RepositoryModelUnloadResponse()

    @_translate
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        response = await self.plane.infer(codec.decode_request(request))
        return codec.encode_response(response)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context: Any) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests run concurrently, answers (or in-band errors) go back in request order, as
        Triton's do; each carries the request id and `triton_final_response`."""
        order: asyncio.Queue[asyncio.Task[pb.ModelStreamInferResponse] | None] = asyncio.Queue()

        async def run(req: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
            try:
                resp = codec.encode_response(await self.plane.infer(codec.decode_request(req)))
            except PierError as exc:
                err = pb.ModelStreamInferResponse(error_message=exc.message)
                err.infer_response.id = req.id
                return err
            resp.parameters["triton_final_response"].bool_param = True
            return pb.ModelStreamInferResponse(infer_response=resp)

        async def read() -> None:
            try:
                async for req in request_iterator:
                    await order.put(asyncio.ensure_future(run(req)))
            finally:
                await order.put(None)

        reader = asyncio.ensure_future(read())
        pending: list[asyncio.Task[pb.ModelStreamInferResponse]] = []
        try:
            while (task := await order.get()) is not None:
                pending.append(task)
                yield await task
                pending.pop()
        finally:
            reader.cancel()
            for t in pending:
                t.cancel()
            while not order.empty():
                leftover = order.get_nowait()
                if leftover is not None:
                    leftover.cancel()

    SystemSharedMemoryStatus = _not_yet("SystemSharedMemoryStatus (system shared memory)")
    SystemSharedMemoryRegister = _not_yet("SystemSharedMemoryRegister (system shared memory)")
    SystemSharedMemoryUnregister = _not_yet("SystemSharedMemoryUnregister (system shared memory)")
    CudaSharedMemoryStatus = _not_yet("CudaSharedMemoryStatus (CUDA shared memory)")
    CudaSharedMemoryRegister = _not_yet("CudaSharedMemoryRegister (CUDA shared memory)")
    CudaSharedMemoryUnregister = _not_yet("CudaSharedMemoryUnregister (CUDA shared memory)")
    TraceSetting = _not_yet("TraceSetting (trace extension)")
    LogSettings = _not_yet("LogSettings (logging extension)")


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING when the server is ready (the `service` field is ignored)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    @_translate
    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:
        status = health_pb2.HealthCheckResponse
        return status(status=status.SERVING if self.plane.ready() else status.NOT_SERVING)


async def start_grpc_server(plane: DataPlane, control: ControlPlane, address: str,
                            max_message_bytes: int) -> grpc.aio.Server:
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(plane, control), server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(plane), server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    await server.start()
    return server
