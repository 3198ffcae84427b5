"""Instances behind one shared job queue: each instance has its own worker thread, and an idle
instance takes the next job (a batch of requests). Execution never runs on the event loop.

A plain thread per instance fed by a SimpleQueue costs less per job than run_in_executor
(no executor bookkeeping, one wake-up each way), which matters for small models where the
hop dominates the compute."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from backends.base import ExecuteResult, ModelInstance
from server.scheduling.base import execute_timed
from server.types import InferenceRequest


@dataclass(slots=True)
class JobResult:
    results: list[ExecuteResult]
    picked_ns: int  # an instance took the job
    start_ns: int  # backend execute began
    end_ns: int  # backend execute returned


_Job = tuple[Sequence[InferenceRequest], asyncio.Future, asyncio.AbstractEventLoop]


def _deliver(fut: asyncio.Future, result: JobResult) -> None:
    if not fut.done():
        fut.set_result(result)


class InstancePool:
    def __init__(self, instances: list[ModelInstance], name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, args=(inst,), name=f"pier-{name}-{i}", daemon=True)
            for i, inst in enumerate(instances)
        ]
        for t in self._threads:
            t.start()

    def queued(self) -> int:
        """Jobs not yet taken by an instance."""
        return self._jobs.qsize()

    @property
    def size(self) -> int:
        return len(self._threads)

    def submit(self, requests: Sequence[InferenceRequest]) -> asyncio.Future:
        """Queue a job; the future resolves (on the loop) with its JobResult."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((requests, fut, loop))
        return fut

    def _work(self, instance: ModelInstance) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                requests, fut, loop = job
                picked = time.perf_counter_ns()
                results, timing = execute_timed(instance, requests)
                try:
                    loop.call_soon_threadsafe(_deliver, fut, JobResult(results, picked, timing.start_ns, timing.end_ns))
                except RuntimeError:  # loop closed: nobody is waiting any more
                    pass
        finally:
            instance.close()

    async def stop(self) -> None:
        """Let queued jobs finish, then stop the workers (each closes its instance)."""
        for _ in self._threads:
            self._jobs.put(None)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._join)

    def _join(self) -> None:
        for t in self._threads:
            t.join()
