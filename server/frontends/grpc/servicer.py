"""GRPCInferenceService and grpc.health.v1: each RPC converts, calls the DataPlane, converts
back. PierError becomes a gRPC status through one table (errors.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

from pier.contract.errors import ErrorCode, PierError, internal, printable, unsupported
from pier.contract.types import InferenceRequest
from pier.control.plane import ControlPlane
from pier.dataplane import shared_memory
from pier.dataplane.plane import DataPlane
from pier.frontends import restrictions
from pier.frontends.grpc import codec
from pier.frontends.grpc.errors import grpc_code
from pier.frontends.grpc.guard import GrpcApiKeys
from pier.frontends.grpc.infer import UnaryInfer
from pier.frontends.grpc.restrict import GrpcRestrictions
from pier.frontends.guards import ApiKeys, RateLimiter
from pier.observability import log_settings
from pier.protocol import grpc_service_pb2 as pb
from pier.protocol import grpc_service_pb2_grpc as pb_grpc
from pier.protocol import health_pb2, health_pb2_grpc
from pier.settings import GrpcSsl

log = logging.getLogger("pier.grpc")


class _Unreadable:
    """A request message that does not parse. The handler answers it INVALID_ARGUMENT; a parser
    that raised would make grpc answer UNKNOWN and log a traceback for every such message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return _Unreadable(str(exc))
    return deserialize


_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}


def _add_service(server: grpc.aio.Server, servicer: Any, service: ServiceDescriptor) -> None:
    """What the generated add_*_to_server does, with requests parsed by `_lenient`."""
    handlers = {}
    for m in service.methods:
        kind = _HANDLER_KINDS[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = kind(getattr(servicer, m.name),
                                request_deserializer=_lenient(message_factory.GetMessageClass(m.input_type).FromString),
                                response_serializer=message_factory.GetMessageClass(m.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _translate(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if log.isEnabledFor(logging.DEBUG):  # --log-verbose / log_verbose_level > 0
            log.debug("gRPC request: %s", method.__name__)
        if type(request) is _Unreadable:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                printable(f"unable to parse the request: {request.error}"))
        try:
            return await method(self, request, context)
        except PierError as exc:
            if log.isEnabledFor(logging.DEBUG):  # as Triton's verbose log of a failed request
                log.debug("gRPC %s failed: %s", method.__name__, exc.message)
            await context.abort(grpc_code(exc.code), exc.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            log.exception("unhandled error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, printable(f"internal error: {type(exc).__name__}: {exc}"))
    return wrapper


def _check_repository(name: str) -> None:
    if name:
        raise unsupported(f"'repository_name' specification is not supported (got '{name}'): leave it empty")


def _repository_parameters(params: Any) -> dict[str, Any]:
    """ModelRepositoryParameter oneofs -> plain values (file contents stay bytes)."""
    out: dict[str, Any] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which else None
    return out


def _refuse_while_stopping(request: InferenceRequest) -> None:
    """A stream's new request while the server drains gets Triton's refusal (its schedulers stop
    taking requests at SIGTERM, all but those of sequences already running): a stream has no
    `Connection: close` to end it after one more answer, as HTTP does, and Triton's clients (and
    its QA) read the refusal as the sign to go elsewhere. Unary calls are still served."""
    sequence = request.parameters.get("sequence_id")
    if sequence not in (None, 0, "") and request.parameters.get("sequence_start") is not True:
        return
    rid = request.id or "<id_unknown>"
    raise PierError(ErrorCode.UNAVAILABLE, f"[request id: {rid}] Server is stopping, scheduler for model has "
                    "stopped accepting new inference requests")


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane, control: ControlPlane, header_pattern: str = "",
                 limiter: RateLimiter | None = None) -> None:
        self.plane = plane
        self.control = control
        self.unary = UnaryInfer(plane, header_pattern, limiter)

    @_translate
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.plane.live())

    @_translate
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.plane.ready())

    @_translate
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        # Triton 2.51 answers OK + ready=false for unknown models and versions (not an error), and
        # INVALID_ARGUMENT for a version that is not an integer.
        try:
            ready = self.plane.model_ready(request.name, request.version)
        except PierError as exc:
            if exc.code is ErrorCode.INVALID_ARG:
                raise
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
        _check_repository(request.repository_name)
        rows = await self.control.index(request.ready)
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
        received = self.unary.received()
        return await self.unary.serve(received, self.unary.decode(request, context))

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context: Any) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests run concurrently. Answers of ordinary models go back in request order with
        `triton_final_response`; decoupled models' responses go out as they are produced (the
        empty final one only when the request sets `triton_enable_empty_final_response`). Errors
        are in-band (`error_message`), each carrying the request id."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        def error(req: pb.ModelInferRequest, exc: PierError) -> pb.ModelStreamInferResponse:
            err = pb.ModelStreamInferResponse(error_message=exc.message)
            err.infer_response.id = req.id
            return err

        async def run(req: pb.ModelInferRequest, after: asyncio.Future, mine: asyncio.Future) -> None:
            decoupled = False
            try:
                try:
                    received = self.unary.received()
                    request = self.unary.decode(req, context)
                    if self.plane.exiting:
                        _refuse_while_stopping(request)
                    model = self.plane.resolve(request.model_name, request.model_version)  # once per request
                    decoupled = model.spec.decoupled
                except PierError as exc:
                    await after
                    out.put_nowait(error(req, exc))
                    return
                if not decoupled:
                    try:
                        resp = await self.unary.serve(received, request, model)
                        resp.parameters["triton_final_response"].bool_param = True
                        message = pb.ModelStreamInferResponse(infer_response=resp)
                    except PierError as exc:
                        message = error(req, exc)
                    await after
                    out.put_nowait(message)
                    return

                def chain(_: asyncio.Future) -> None:  # later ordered answers wait only for earlier ones
                    if not mine.done():
                        mine.set_result(None)

                after.add_done_callback(chain)
                empty_final = request.parameters.get("triton_enable_empty_final_response") is True
                with self.plane.shared_memory.holding(request.shm_regions):
                    async for item in self.plane.infer_stream(request, model):
                        if isinstance(item, PierError):
                            out.put_nowait(error(req, item))
                            continue
                        final = bool(item.parameters.get("triton_final_response"))
                        if final and not item.outputs and not empty_final:
                            continue
                        resp = codec.encode_response(item, request, self.plane.shared_memory)
                        if final and not item.outputs:
                            resp.ClearField("model_version")  # as Triton's empty final response
                        resp.parameters["triton_final_response"].bool_param = final
                        out.put_nowait(pb.ModelStreamInferResponse(infer_response=resp))
            except PierError as exc:  # the request was refused (validation) before it produced anything
                out.put_nowait(error(req, exc))
            except Exception as exc:  # never lose the stream over one request
                log.exception("stream request failed")
                if not decoupled:  # its answer still goes back in request order
                    await after
                out.put_nowait(error(req, PierError(ErrorCode.INTERNAL, f"internal error: {exc}")))
            finally:
                if not after.done():
                    await after
                if not mine.done():
                    mine.set_result(None)

        unreadable: list[str] = []

        async def read() -> None:
            previous: asyncio.Future = loop.create_future()
            previous.set_result(None)
            try:
                async for req in request_iterator:
                    if type(req) is _Unreadable:
                        unreadable.append(req.error)
                        break
                    mine: asyncio.Future = loop.create_future()
                    task = asyncio.ensure_future(run(req, previous, mine))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    previous = mine
            except Exception as exc:  # a message that is not a ModelInferRequest ends the stream
                unreadable.append(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            finally:
                while tasks:  # what was read before still gets its answers
                    await asyncio.gather(*list(tasks), return_exceptions=True)
                out.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (message := await out.get()) is not None:
                yield message
            if unreadable:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    printable(f"unable to read a request of the stream: {unreadable[0]}"))
        finally:
            reader.cancel()
            for t in list(tasks):
                t.cancel()

    @_translate
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Any) -> pb.SystemSharedMemoryStatusResponse:
        out = pb.SystemSharedMemoryStatusResponse()
        for region in self.plane.shared_memory.status(request.name):
            out.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return out

    @_translate
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Any) -> pb.SystemSharedMemoryRegisterResponse:
        try:
            self.plane.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        except shared_memory.UnopenableRegion as exc:
            raise internal(exc.message) from None
        return pb.SystemSharedMemoryRegisterResponse()

    @_translate
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context: Any) -> pb.SystemSharedMemoryUnregisterResponse:
        self.plane.shared_memory.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_translate
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest,
                                     context: Any) -> pb.CudaSharedMemoryStatusResponse:
        shared_memory.cuda_status(request.name)  # none registered: empty, or an unknown name
        return pb.CudaSharedMemoryStatusResponse()

    @_translate
    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest,
                                       context: Any) -> pb.CudaSharedMemoryRegisterResponse:
        shared_memory.cuda_register(request.name)
        return pb.CudaSharedMemoryRegisterResponse()

    @_translate
    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context: Any) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()  # nothing registered: nothing to do (as Triton)

    @_translate
    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Any) -> pb.TraceSettingResponse:
        """An empty value list resets the setting (a model's falls back to the global one)."""
        changes = {k: (list(v.value) if v.value else None) for k, v in request.settings.items()}
        settings = self.plane.trace_settings(request.model_name, changes)
        out = pb.TraceSettingResponse()
        for key, value in settings.items():
            out.settings[key].value.extend(value if isinstance(value, list) else [value])
        return out

    @_translate
    async def LogSettings(self, request: pb.LogSettingsRequest, context: Any) -> pb.LogSettingsResponse:
        changes = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in request.settings.items()
                   if v.WhichOneof("parameter_choice")}
        out = pb.LogSettingsResponse()
        for key, value in log_settings.update(changes).items():
            kind = "bool" if isinstance(value, bool) else "uint32" if isinstance(value, int) else "string"
            setattr(out.settings[key], kind + "_param", value)
        return out


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING when the server is ready (the `service` field is ignored)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    @_translate
    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:
        status = health_pb2.HealthCheckResponse
        return status(status=status.SERVING if self.plane.ready() else status.NOT_SERVING)


async def start_grpc_server(plane: DataPlane, control: ControlPlane, address: str, max_message_bytes: int,
                            options: Sequence[tuple[str, int]] = (), reuse_port: bool = False,
                            ssl: GrpcSsl | None = None, restricted: restrictions.Rules | None = None,
                            header_pattern: str = "", keys: ApiKeys | None = None,
                            limiter: RateLimiter | None = None) -> grpc.aio.Server:
    """The gRPC endpoint; `options` are extra grpc server options (keepalive, HTTP/2 pings), `ssl`
    serves TLS (mutual: client certificates must chain to its root certificate), `restricted`
    names protocol categories that need a header (--grpc-restricted-protocol)."""
    server = grpc_server(max_message_bytes, options, reuse_port, restricted, keys)
    _add_service(server, InferenceServicer(plane, control, header_pattern, limiter),
                 pb.DESCRIPTOR.services_by_name["GRPCInferenceService"])
    _add_service(server, HealthServicer(plane), health_pb2.DESCRIPTOR.services_by_name["Health"])
    await bind_and_start(server, address, ssl)
    return server


def grpc_server(max_message_bytes: int, options: Sequence[tuple[str, int]] = (), reuse_port: bool = False,
                restricted: restrictions.Rules | None = None, keys: ApiKeys | None = None) -> grpc.aio.Server:
    """A grpc.aio server with Pier's options and interceptors, no services yet."""
    interceptors: list[grpc.aio.ServerInterceptor] = [GrpcRestrictions(restricted)] if restricted else []
    if keys is not None and keys.enabled:
        interceptors.append(GrpcApiKeys(keys))
    return grpc.aio.server(interceptors=interceptors or None, options=[
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", int(reuse_port)),
        *options,
    ])


async def bind_and_start(server: grpc.aio.Server, address: str, ssl: GrpcSsl | None = None) -> None:
    if ssl is not None:
        credentials = grpc.ssl_server_credentials(
            [(ssl.server_key.read_bytes(), ssl.server_cert.read_bytes())],
            root_certificates=ssl.root_cert.read_bytes() if ssl.root_cert is not None else None,
            require_client_auth=ssl.mutual)
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    await server.start()
