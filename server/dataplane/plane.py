"""Health, metadata, config, statistics and inference: one method per operation, shared by the
HTTP and gRPC frontends. Takes and returns internal types only."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol, TypeVar

from pier import __version__
from pier.contract.errors import PierError, invalid_arg, unavailable, unsupported
from pier.contract.types import InferenceRequest, InferenceResponse, ModelSpec, Outputs, RequestedOutput, Tensor
from pier.dataplane import degrade
from pier.dataplane.instances import InstanceOperations
from pier.dataplane.response_cache import ResponseCache
from pier.dataplane.shared_memory import SystemSharedMemory
from pier.lifecycle.loaded_model import LoadedModel
from pier.lifecycle.routing import RoutingTable
from pier.observability.otel import OtelTrace
from pier.observability.tracing import Trace, Tracer
from pier.protocol import model_config_pb2 as mc
from pier.repository.source import is_version
from pier.repository.spec import config_to_json
from pier.scheduling.base import WorkItem
from pier.settings import SERVER_NAME
from pier.tensors.classification import class_count, classify
from pier.tensors.validation import to_api_outputs, validate_request

T = TypeVar("T")

# What this build implements, in Triton's order and spelling.
EXTENSIONS = ("classification", "sequence", "model_repository", "model_repository(unload_dependents)",
              "schedule_policy", "model_configuration", "system_shared_memory", "binary_tensor_data", "parameters",
              "statistics", "trace", "logging")


def _as_requested(t: Tensor, requested: RequestedOutput, spec: ModelSpec) -> Tensor:
    """Output `t` as its request asked for it: its top classes when it set `classification`."""
    if requested.parameters and requested.parameters.get("classification"):
        return classify(t, class_count(requested.parameters), spec.max_batch_size > 0, spec.labels.get(t.name, ()))
    return t


class Stamping(Protocol):
    @property
    def on(self) -> bool:
        """Whether requests get the frontend's receive stamp (tracing is on for some model)."""

    @property
    def propagates(self) -> bool:
        """Whether frontends hand on the caller's traceparent (OpenTelemetry trace mode)."""


class InferencePlane(Protocol):
    """What the inference handlers (HTTP `POST .../infer`, gRPC ModelInfer; frontends/http/infer.py,
    frontends/grpc/infer.py) need of a data plane: DataPlane in the server process, RemotePlane in
    a frontend process (frontends/workers/worker.py), which serves only requests that name no
    shared-memory region (its `shared_memory` is None: those go to the server whole, decided
    before any tensor is decoded)."""

    @property
    def exiting(self) -> bool:
        """The server drains: answers say `Connection: close`."""

    @property
    def tracer(self) -> Stamping: ...

    @property
    def shared_memory(self) -> SystemSharedMemory | None:
        """The regions requests may name (None: none may)."""

    async def serve(self, request: InferenceRequest, encode: Callable[[InferenceResponse], T],
                    model: LoadedModel | None = None, protocol: str = "", received_ns: int = 0) -> T:
        """One request: run it, then `encode` the answer (see DataPlane.serve)."""


class DataPlane(InstanceOperations):
    def __init__(self, routes: RoutingTable, strict_readiness: bool, tracer: Tracer | None = None,
                 server_id: str = SERVER_NAME, cache: ResponseCache | None = None) -> None:
        self.server_id = server_id
        self.cache = cache  # --cache-config: models with response_cache enabled use it
        self._routes = routes  # published by the model life cycle
        self._strict = strict_readiness
        self._started = False
        self._exiting = False
        self._keys = itertools.count()
        self._running: dict[int, tuple[LoadedModel, InferenceRequest, float]] = {}  # in flight: model, request, since
        self._idle = asyncio.Event()
        self._idle.set()
        self.shared_memory = SystemSharedMemory()  # regions clients registered (system shared memory extension)
        self.tracer = tracer or Tracer()  # request tracing (trace extension)

    # ---- server state --------------------------------------------------------------------

    def mark_started(self) -> None:
        self._started = True

    def begin_exit(self) -> None:
        self._exiting = True

    @property
    def exiting(self) -> bool:
        return self._exiting

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def running(self) -> list[str]:
        """The requests in flight now, oldest first, in words: what the exit timeout names when it
        expires. Safe from any thread (it reads a copy, which the interpreter lock makes whole)."""
        now = time.monotonic()
        return [f"model '{m.spec.name}' version {m.version} request '{r.id or '<no id>'}' ({now - since:.1f} s)"
                for m, r, since in sorted(self._running.copy().values(), key=lambda e: e[2])]

    def in_flight(self) -> dict[int, int]:
        """Requests in flight now per loaded version (by `LoadedModel.load_id`): the status page's."""
        counts: dict[int, int] = {}
        for m, _, _ in self._running.copy().values():
            counts[m.load_id] = counts.get(m.load_id, 0) + 1
        return counts

    def live(self) -> bool:
        """Live while it drains after SIGTERM too (Triton answers "Server exiting" there): a
        liveness probe that failed would have the kubelet kill a pod finishing its requests."""
        return True

    def ready(self) -> bool:
        if self._exiting:
            raise unavailable("Server exiting")
        if not self._started:
            return False
        return self._routes.all_ready() if self._strict else True

    def server_metadata(self) -> dict[str, Any]:
        return {"name": self.server_id, "version": __version__, "extensions": list(EXTENSIONS)}

    # ---- models --------------------------------------------------------------------------

    def resolve(self, name: str, version: str = "") -> LoadedModel:
        """The one routing decision of a request (unversioned requests draw the rollout weights
        here). A frontend that must read the model's signature to decode a request (raw binary,
        generate) or its transaction policy (a gRPC stream) resolves first, then hands the
        result to infer / infer_stream / responses, so that one version decodes, validates and
        runs it."""
        return self._routes.resolve(name, version)  # an empty name is an unknown model, as in Triton

    def not_serving(self, name: str) -> str | None:
        """Why a model this server knows has no version serving now, in words (None: one serves,
        or the name is unknown): a frontend that lists only what serves says so, not "unknown"."""
        route = self._routes.route(name)
        if route is None or not route.known or route.ready:
            return None
        try:
            self._routes.resolve(name)
        except PierError as exc:
            return exc.message
        return None

    def model_ready(self, name: str, version: str = "") -> bool:
        """True when a version can serve; unknown models/versions raise as Triton's lookup does."""
        self.resolve(name, version)
        return True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        return self.describe(self.resolve(name, version), all_versions=not version)

    def describe(self, model: LoadedModel, all_versions: bool = False) -> dict[str, Any]:
        """Metadata of a resolved model version (`all_versions`: list every READY version)."""
        spec = model.spec
        versions = [str(v) for v in self._routes.ready_versions(model.key)] if all_versions else [model.version_str]
        return {
            "name": spec.name,
            "versions": versions,
            "platform": spec.api_platform,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": spec.api_shape(t)} for t in spec.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": spec.api_shape(t)} for t in spec.outputs],
        }

    def models_with_backend(self, backend: str) -> dict[str, dict[str, Any]]:
        """Models with a READY version served by `backend` (e.g. the OpenAI API's "llm"), each with
        its newest version's first instance's `info()`."""
        out: dict[str, dict[str, Any]] = {}
        for m in sorted(self._routes.loaded_models(), key=lambda m: m.version):
            if m.spec.backend == backend:
                out[m.spec.name] = m.instances[0].info() if m.instances else {}
        return dict(sorted(out.items()))

    def models_with_parameter(self, key: str) -> dict[str, str]:
        """Models with a READY version whose config sets parameter `key` (its newest version's value)."""
        out: dict[str, str] = {}
        for m in sorted(self._routes.loaded_models(), key=lambda m: m.version):
            if key in m.spec.parameters:
                out[m.spec.name] = m.spec.parameters[key]
        return dict(sorted(out.items()))

    def model_config_json(self, name: str, version: str = "") -> dict[str, Any]:
        return config_to_json(self.resolve(name, version).config)

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        return self.resolve(name, version).config

    def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        """Triton's statistics lookup: all loaded versions, one model's, or one version's."""
        if not name:
            models = self._routes.loaded_models()
        else:
            models = [m for m in self._routes.loaded_models() if m.spec.name == name]
            if not models:
                raise invalid_arg(f"requested model '{name}' is not available")
            if version:
                models = [m for m in models if is_version(version) and m.version == int(version)]
                if not models:
                    raise invalid_arg(f"requested model version is not available for model '{name}'")
        models.sort(key=lambda m: (m.spec.name, m.version))
        return [m.stats.as_dict(m.spec.name, m.version_str) for m in models]

    # ---- inference -----------------------------------------------------------------------

    def _target(self, request: InferenceRequest, model: LoadedModel | None) -> LoadedModel:
        """The version this request runs on: the one its frontend resolved, else resolved now.
        While the server exits requests still run, as in Triton (its InferAsync allows them, so
        that a sequence spanning requests completes): models unload only after the drain. A model
        that is overloaded hands it to its fallback or refuses it (dataplane/degrade.py)."""
        model = model if model is not None else self.resolve(request.model_name, request.model_version)
        return degrade.admit(model, request, self.resolve)

    def _begin(self, model: LoadedModel, request: InferenceRequest) -> int:
        key = next(self._keys)
        self._running[key] = (model, request, time.monotonic())
        self._idle.clear()
        return key

    def _end(self, key: int) -> None:
        del self._running[key]
        if not self._running:
            self._idle.set()

    @staticmethod
    def _response(model: LoadedModel, request: InferenceRequest, result: Outputs, batch: int,
                  parameters: dict[str, Any] | None = None) -> InferenceResponse:
        outputs = to_api_outputs(model.spec, result.tensors, batch)
        if request.outputs:
            by_name = {t.name: t for t in outputs}
            outputs = [_as_requested(by_name[o.name], o, model.spec) for o in request.outputs if o.name in by_name]
        if result.parameters:  # the model's own
            parameters = {**result.parameters, **(parameters or {})}
        return InferenceResponse(model.spec.name, model.version_str, outputs, id=request.id,
                                 parameters=parameters or {})

    async def infer(self, request: InferenceRequest, model: LoadedModel | None = None) -> InferenceResponse:
        """One request, one response (models that are not decoupled). `model`: the version the
        frontend resolved for it (see resolve), else it is resolved here."""
        model = self._target(request, model)
        if model.spec.decoupled:
            raise unsupported(f"this end point doesn't support models with decoupled transaction policy: "
                              f"'{request.model_name}' streams (use gRPC ModelStreamInfer or HTTP generate_stream)")
        return await self._infer(model, request)

    async def serve(self, request: InferenceRequest, encode: Callable[[InferenceResponse], T],
                    model: LoadedModel | None = None, protocol: str = "", received_ns: int = 0) -> T:
        """One request as a frontend serves it: `infer`, then `encode` (the frontend's wire format,
        which writes outputs asked for in shared memory). The shared-memory regions the request
        names are held until its outputs are written; with tracing on, the trace carries the
        frontend's receive (from `received_ns`; 0: not traced) and send stamps for `protocol`
        ("HTTP" or "GRPC")."""
        trace = self.tracer.begin(request, protocol, received_ns) if received_ns and self.tracer.on else None
        if trace is None and not request.shm_regions:  # the common case, without the bookkeeping
            return encode(await self.infer(request, model))
        with self.shared_memory.holding(request.shm_regions):
            response = await self.infer(request, model)
            if trace is not None:
                trace.stamp(f"{protocol}_SEND_START")
            out = encode(response)
        if trace is not None:
            trace.stamp(f"{protocol}_SEND_END")
            self.tracer.finish(trace)
        return out

    def trace_settings(self, model: str = "", changes: dict[str, Any] | None = None) -> dict[str, Any]:
        """The trace extension: a model's (or the global) settings, after applying `changes`."""
        if model:
            try:
                self.model_ready(model)
            except PierError as exc:  # Triton answers an unknown model's trace settings with 400
                raise invalid_arg(exc.message) from None
        return self.tracer.update(changes, model) if changes else self.tracer.settings(model)

    def _trace(self, model: LoadedModel, request: InferenceRequest) -> tuple[Trace | OtelTrace | None, bool]:
        """The request's trace (one its frontend began, or one sampled here, which the plane then
        finishes: owned), stamped up to QUEUE_START. Only called when tracing is on."""
        trace, owned = request.trace or None, False
        if request.trace is None:
            trace = request.trace = self.tracer.sample(model.spec.name, request.id, request.trace_context)
            owned = trace is not None
        if trace is not None:
            trace.start(model.version)
            if trace.context:  # OpenTelemetry: the model sees (and hands on) its own span's context
                request.trace_context = trace.context
            for t in request.inputs:
                trace.tensor("TENSOR_QUEUE_INPUT", t.name, t.datatype, t.shape, t.data)
            trace.stamp("QUEUE_START")
        return trace, owned

    def _end_trace(self, trace: Trace | OtelTrace, owned: bool, outputs: list[Tensor]) -> None:
        for t in outputs:
            trace.tensor("TENSOR_BACKEND_OUTPUT", t.name, t.datatype, t.shape, t.data)
        trace.stamp("REQUEST_END")
        if owned:
            self.tracer.finish(trace)

    async def _infer(self, model: LoadedModel, request: InferenceRequest,
                     batch: int | None = None) -> InferenceResponse:
        """Run one request (`batch`: its batch size when already validated, for a cache miss)."""
        if batch is None:
            # A request refused here never reached the model: as in Triton 2.51 (probed), it counts
            # in neither the statistics' fail count nor nv_inference_request_failure.
            batch = validate_request(model.spec, request)
            if self.cache is not None and model.spec.response_cache:
                return await self._infer_cached(model, request, batch, self.cache)
        trace, owned = self._trace(model, request) if self.tracer.on or request.trace else (None, False)
        key = self._begin(model, request)
        try:
            result = await model.scheduler.enqueue(WorkItem(request, batch))
        finally:
            self._end(key)
        if isinstance(result, PierError):
            if trace is not None:
                self._end_trace(trace, owned, [])
            raise result
        try:
            response = self._response(model, request, result, batch)
        except PierError:  # a classification the output's datatype cannot give
            if trace is not None:
                self._end_trace(trace, owned, [])
            raise
        if trace is not None:
            trace.stamp("INFER_RESPONSE_COMPLETE")
            self._end_trace(trace, owned, response.outputs)
        return response

    async def _infer_cached(self, model: LoadedModel, request: InferenceRequest, batch: int,
                            cache: ResponseCache) -> InferenceResponse:
        key, outputs, lookup_ns = cache.lookup(model.spec.name, model.load_id, request)
        if outputs is not None:
            model.stats.record_cache_hit(lookup_ns)
            return InferenceResponse(model.spec.name, model.version_str, outputs, id=request.id)
        response = await self._infer(model, request, batch)  # an error is raised, so never cached
        model.stats.record_cache_miss(lookup_ns + cache.insert(key, response.outputs))
        return response

    async def infer_stream(self, request: InferenceRequest,
                           model: LoadedModel | None = None) -> AsyncGenerator[InferenceResponse | PierError, None]:
        """Every response of one request: one for ordinary models; for decoupled models each
        response the model sends (errors in-band as PierError), the last one carrying
        parameters["triton_final_response"] = True (with no outputs when the model sent its
        final flag alone). Closing the iterator early cancels the request. `model` as in infer."""
        model = self._target(request, model)
        if not model.spec.decoupled:
            yield await self._infer(model, request)
            return
        batch = validate_request(model.spec, request)
        trace, owned = self._trace(model, request) if self.tracer.on or request.trace else (None, False)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[Any, bool]] = asyncio.Queue()

        def sink(result: Outputs | PierError | None, final: bool) -> None:
            if asyncio._get_running_loop() is loop:  # a model answering on the loop itself: no wake-up needed
                queue.put_nowait((result, final))
            else:
                loop.call_soon_threadsafe(queue.put_nowait, (result, final))

        request.response_sink = sink
        key = self._begin(model, request)
        work = WorkItem(request, batch)
        executed = asyncio.ensure_future(model.scheduler.enqueue(work))
        first = True
        executed.add_done_callback(lambda task: queue.put_nowait((task, False)))
        try:
            while True:
                item, final = await queue.get()
                if isinstance(item, asyncio.Future):
                    outcome = item.result()
                    if isinstance(outcome, PierError):  # the model failed this request
                        yield outcome
                        return
                    continue
                if isinstance(item, PierError):
                    yield item
                else:
                    params = {"triton_final_response": final}
                    try:
                        response = self._response(model, request, item if item is not None else Outputs([]), batch,
                                                  params)
                    except PierError as exc:  # a classification the output's datatype cannot give
                        yield exc
                        return
                    if first:  # nv_inference_first_response_histogram_ms
                        model.stats.record_first_response(time.perf_counter_ns() - work.enqueued_ns)
                        first = False
                    if trace is not None:  # one per response, as Triton traces decoupled models
                        trace.stamp("INFER_RESPONSE_COMPLETE")
                        for t in response.outputs:
                            trace.tensor("TENSOR_BACKEND_OUTPUT", t.name, t.datatype, t.shape, t.data)
                    yield response
                if final:
                    return
        finally:
            request.cancelled = True
            on_cancel, request.on_cancel = request.on_cancel, None
            if on_cancel is not None:
                on_cancel()
            self._end(key)
            if trace is not None:
                self._end_trace(trace, owned, [])

    async def responses(self, request: InferenceRequest,
                        model: LoadedModel | None = None) -> AsyncGenerator[InferenceResponse, None]:
        """`infer_stream` for callers that stop at the first error: the responses that carry
        outputs (a decoupled model's flag-only final left out); an in-band error is raised.
        Closing the iterator early cancels the request."""
        stream = self.infer_stream(request, model)
        try:
            async for item in stream:
                if isinstance(item, PierError):
                    raise item
                if item.outputs:
                    yield item
        finally:
            await stream.aclose()
