"""Default scheduler: each request runs alone on the next idle instance (Triton's behaviour
for models without dynamic or sequence batching). A model with ragged batching config still gets
its batch of one shaped as Triton's backends shape it (ragged inputs 1-D, batch inputs added,
batch outputs scattered): pass its BatchLayout."""

from __future__ import annotations

import time

from pier.contract.backend import ModelInstance
from pier.contract.errors import PierError, internal
from pier.contract.types import ExecuteResult
from pier.observability.statistics import ModelStatistics
from pier.scheduling.base import Scheduler, WorkItem
from pier.scheduling.batch import merge, split
from pier.scheduling.instance_pool import JobResult, instance_pool
from pier.scheduling.ragged import BatchLayout


class DirectScheduler(Scheduler):
    def __init__(self, instances: list[ModelInstance], stats: ModelStatistics, name: str,
                 layout: BatchLayout | None = None) -> None:
        self._pool = instance_pool(instances, name)
        self._layout = layout
        self._stats = stats
        self._inflight = 0

    async def enqueue(self, item: WorkItem) -> ExecuteResult:
        request = item.request
        if self._layout is not None:
            try:
                request = merge([request], self._layout)
            except PierError as exc:
                self._stats.record_request(False, 0, reason="OTHER")
                return exc
        self._inflight += 1
        try:
            job: JobResult = await self._pool.submit([request])
        finally:
            self._inflight -= 1
        done = time.perf_counter_ns()
        if len(job.results) != 1:
            return internal(f"backend returned {len(job.results)} results for 1 request")
        input_ns = job.start_ns - job.picked_ns
        infer_ns = job.end_ns - job.start_ns
        output_ns = done - job.end_ns
        if item.request.trace:
            item.request.trace.compute(job.picked_ns, job.start_ns, job.end_ns, done)
        result = job.results[0]
        if self._layout is not None:
            result = split(result, [item.batch_size], [item.request], self._layout)[0]
        ok = not isinstance(result, Exception)
        self._stats.record_execution(item.batch_size, input_ns, infer_ns, output_ns, item.batch_size if ok else 0)
        self._stats.record_request(
            ok, done - item.enqueued_ns, job.picked_ns - item.enqueued_ns, input_ns, infer_ns, output_ns,
            reason=None if ok else "BACKEND",
        )
        return result

    def inflight_count(self) -> int:
        return self._inflight

    def pending_count(self) -> int:
        return self._pool.queued()

    async def stop(self) -> None:
        await self._pool.stop()
