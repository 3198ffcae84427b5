"""The data plane as backends see it (pier.contract.backend.ServerServices): what a Python model's BLS
calls and other model-calling backends use. Requests go through DataPlane.infer like a
client's; blocking forms are for worker threads, async forms work from any event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from pier.contract.errors import PierError, internal
from pier.contract.types import InferenceRequest, InferenceResponse
from pier.control.plane import ControlPlane
from pier.dataplane.plane import DataPlane

_END = object()


class PlaneServices:
    """`control`: the server's control plane, looked up when a model calls it (the control plane
    is built on the repository, whose life cycle is built with these services)."""

    def __init__(self, plane: DataPlane, loop: asyncio.AbstractEventLoop,
                 control: Callable[[], ControlPlane] | None = None) -> None:
        self._plane = plane
        self._control = control
        self._loop = loop
        self._loop_thread = threading.get_ident()

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _check_thread(self) -> None:
        if threading.get_ident() == self._loop_thread:
            raise internal("a blocking model call (BLS exec) cannot run on the server's event loop")

    def _child(self, request: InferenceRequest) -> InferenceRequest:
        """A BLS call that names its caller's trace (`trace=request.trace()`): in OpenTelemetry
        mode its spans hang under the caller's model span, whatever the sampling settings."""
        if request.trace_context and request.trace is None:
            request.trace = self._plane.tracer.child_of(request.trace_context, request.model_name, request.id)
        return request

    def infer(self, request: InferenceRequest) -> InferenceResponse:
        self._check_thread()
        return asyncio.run_coroutine_threadsafe(self._plane.infer(self._child(request)), self._loop).result()

    async def _pump(self, request: InferenceRequest, put: Any) -> None:
        try:
            async for item in self._plane.infer_stream(self._child(request)):
                put(item)
        except PierError as exc:
            put(exc)
        finally:
            put(_END)

    def infer_stream(self, request: InferenceRequest) -> Iterator[InferenceResponse | PierError]:
        self._check_thread()
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        asyncio.run_coroutine_threadsafe(self._pump(request, items.put), self._loop)
        while (item := items.get()) is not _END:
            yield item

    async def infer_async(self, request: InferenceRequest) -> InferenceResponse:
        self._child(request)
        if asyncio.get_running_loop() is self._loop:
            return await self._plane.infer(request)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._plane.infer(request), self._loop))

    async def infer_stream_async(self, request: InferenceRequest) -> AsyncIterator[InferenceResponse | PierError]:
        caller = asyncio.get_running_loop()
        if caller is self._loop:  # on the server's loop: closing this iterator cancels the request
            try:
                async for item in self._plane.infer_stream(self._child(request)):
                    yield item
            except PierError as exc:
                yield exc
            return
        items: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            caller.call_soon_threadsafe(items.put_nowait, item)

        asyncio.run_coroutine_threadsafe(self._pump(request, put), self._loop)
        while (item := await items.get()) is not _END:
            yield item

    # ---- model management (pb_utils.load_model / unload_model / is_model_ready) ------------

    def _on_loop(self, work: Any) -> Any:
        self._check_thread()
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def load_model(self, name: str, parameters: dict[str, Any]) -> None:
        if self._control is None:
            raise internal("model control is not available to models here")
        self._on_loop(self._control().load(name, parameters))

    def unload_model(self, name: str, parameters: dict[str, Any]) -> None:
        if self._control is None:
            raise internal("model control is not available to models here")
        self._on_loop(self._control().unload(name, parameters))

    def model_ready(self, name: str, version: str) -> bool:
        async def ready() -> bool:
            try:
                return self._plane.model_ready(name, version)
            except PierError:
                return False

        return bool(self._on_loop(ready()))
