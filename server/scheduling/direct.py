"""Default scheduler: each request runs alone on the next idle instance (Triton's behaviour
for models without dynamic or sequence batching)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from backends.base import ExecuteResult, ModelInstance
from server.errors import internal
from server.scheduling.base import Scheduler, WorkItem, run_on
from server.statistics import ModelStatistics


class DirectScheduler(Scheduler):
    def __init__(self, instances: list[ModelInstance], stats: ModelStatistics) -> None:
        self._instances = instances
        self._idle: asyncio.Queue[ModelInstance] = asyncio.Queue()
        for inst in instances:
            self._idle.put_nowait(inst)
        self._executor = ThreadPoolExecutor(max_workers=len(instances), thread_name_prefix="pier-exec")
        self._stats = stats
        self._inflight = 0
        self._drained = asyncio.Event()
        self._drained.set()

    async def enqueue(self, item: WorkItem) -> ExecuteResult:
        self._inflight += 1
        self._drained.clear()
        try:
            instance = await self._idle.get()
            dequeued = time.perf_counter_ns()
            try:
                results, timing = await run_on(self._executor, instance, [item.request])
            finally:
                self._idle.put_nowait(instance)
            done = time.perf_counter_ns()
            if len(results) != 1:
                return internal(f"backend returned {len(results)} results for 1 request")
            input_ns = timing.start_ns - dequeued
            infer_ns = timing.end_ns - timing.start_ns
            output_ns = done - timing.end_ns
            self._stats.record_execution(item.batch_size, input_ns, infer_ns, output_ns)
            result = results[0]
            self._stats.record_request(
                not isinstance(result, Exception), done - item.enqueued_ns,
                dequeued - item.enqueued_ns, input_ns, infer_ns, output_ns,
            )
            return result
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._drained.set()

    def inflight_count(self) -> int:
        return self._inflight

    async def stop(self) -> None:
        await self._drained.wait()
        for inst in self._instances:
            inst.close()
        self._executor.shutdown(wait=False)
