"""Instances behind one shared job queue: each instance has its own worker thread, and an idle
instance takes the next job (a batch of requests).

A plain thread per instance fed by a SimpleQueue costs less per job than run_in_executor (no
executor bookkeeping, one wake-up each way). For models whose executions are tiny (moving
average under INLINE_BELOW_NS, after a warm-up on the workers), a job that finds the queue empty
and an instance free runs inline on the event loop instead: the two thread hops cost more than
such an execution, and blocking the loop that briefly costs no more than parsing a request.
Each instance is guarded by a lock, so it never runs two jobs at once whichever thread runs it.

Instances that run their batches in another process (`awaits_execute`: a Python model's stub)
have no worker thread: `LoopPool` calls their `begin_execute` on the event loop and they finish
it there, so a batch goes out and its answer comes back with no thread in between.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pier.contract.backend import ModelInstance
from pier.contract.types import ExecuteResult, InferenceRequest
from pier.scheduling.base import execute_timed, raised

INLINE_BELOW_NS = 100_000  # executions this short (moving average) may run on the event loop
_WARMUP = 32  # executions observed on the workers before inline execution is considered


@dataclass(slots=True)
class JobResult:
    results: list[ExecuteResult]
    picked_ns: int  # an instance took the job
    start_ns: int  # backend execute began
    end_ns: int  # backend execute returned


Done = Callable[[JobResult], None]  # called on the event loop with a job's result
_Job = tuple[Sequence[InferenceRequest], Done, asyncio.AbstractEventLoop]


def _resolver(fut: asyncio.Future) -> Done:
    def deliver(result: JobResult) -> None:
        if not fut.done():
            fut.set_result(result)
    return deliver


class InstancePool:
    def __init__(self, instances: list[ModelInstance], name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._slots = [(inst, threading.Lock()) for inst in instances]
        self._inline_ok = all(inst.may_run_on_event_loop for inst in instances)
        self.unbatched = any(inst.unbatched for inst in instances)  # execute() takes the requests as they are
        self._avg_ns = float(INLINE_BELOW_NS * 10)
        self._observed = 0
        self._threads = [
            threading.Thread(target=self._work, args=slot, name=f"pier-{name}-{i}", daemon=True)
            for i, slot in enumerate(self._slots)
        ]
        for t in self._threads:
            t.start()

    def queued(self) -> int:
        """Jobs not yet taken by an instance."""
        return self._jobs.qsize()

    @property
    def size(self) -> int:
        return len(self._threads)

    def _observe(self, ns: int) -> None:
        # Plain float/int writes from several threads: a lost update only delays the average.
        self._avg_ns += (ns - self._avg_ns) * 0.05
        self._observed += 1

    def run_inline(self, requests: Sequence[InferenceRequest]) -> JobResult | None:
        """Run the job on the event loop now if the module doc's conditions hold (tiny executions,
        queue empty, an instance free); None when it must go to the workers (`submit`)."""
        if not (self._inline_ok and self._observed >= _WARMUP and self._avg_ns < INLINE_BELOW_NS
                and self._jobs.empty()):
            return None
        for instance, lock in self._slots:
            if lock.acquire(blocking=False):
                try:
                    picked = time.perf_counter_ns()
                    results, timing = execute_timed(instance, requests)
                finally:
                    lock.release()
                self._observe(timing.end_ns - timing.start_ns)
                return JobResult(results, picked, timing.start_ns, timing.end_ns)
        return None

    def submit(self, requests: Sequence[InferenceRequest]) -> asyncio.Future:
        """Queue a job (or run it inline, see the module doc); the future resolves on the loop."""
        fut = asyncio.get_running_loop().create_future()
        job = self.run_inline(requests)
        if job is not None:
            fut.set_result(job)
        else:
            self.start(requests, _resolver(fut))
        return fut

    def start(self, requests: Sequence[InferenceRequest], done: Done) -> None:
        """Queue a job for the worker threads (the caller already tried `run_inline`); `done` gets
        its result on the loop."""
        self._jobs.put((requests, done, asyncio.get_running_loop()))

    def _work(self, instance: ModelInstance, lock: threading.Lock) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                requests, done, loop = job
                with lock:
                    picked = time.perf_counter_ns()
                    results, timing = execute_timed(instance, requests)
                self._observe(timing.end_ns - timing.start_ns)
                try:
                    loop.call_soon_threadsafe(done, JobResult(results, picked, timing.start_ns, timing.end_ns))
                except RuntimeError:  # loop closed: nobody is waiting any more
                    pass
        finally:
            with lock:
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


class _Started:
    """A job a LoopPool's instance began: `finish` is what the instance calls (once) with its results."""

    __slots__ = ("pool", "instance", "done", "picked", "starting", "finished")

    def __init__(self, pool: LoopPool, instance: ModelInstance, done: Done) -> None:
        self.pool, self.instance, self.done = pool, instance, done
        self.picked = time.perf_counter_ns()
        self.starting = True  # begin_execute has not returned yet
        self.finished = False

    def finish(self, results: list[ExecuteResult]) -> None:
        if not self.finished:
            self.finished = True
            self.pool._finished(self, results)


class LoopPool:
    """InstancePool's interface for instances that run their executions elsewhere and finish them
    on the event loop (`awaits_execute`): an idle instance takes the next job at once; jobs wait in
    arrival order while every instance is busy."""

    def __init__(self, instances: list[ModelInstance], name: str) -> None:
        self._idle = list(reversed(instances))
        self._instances = instances
        self._jobs: deque[tuple[Sequence[InferenceRequest], Done]] = deque()
        self._busy = 0  # jobs started and not finished
        self._stopped: asyncio.Event | None = None  # set when stop() waits and the last job finished
        self.unbatched = any(inst.unbatched for inst in instances)

    def queued(self) -> int:
        return len(self._jobs)

    @property
    def size(self) -> int:
        return len(self._instances)

    def run_inline(self, requests: Sequence[InferenceRequest]) -> JobResult | None:
        return None  # the execution is elsewhere: there is nothing to run on the loop

    def submit(self, requests: Sequence[InferenceRequest]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.start(requests, _resolver(fut))
        return fut

    def start(self, requests: Sequence[InferenceRequest], done: Done) -> None:
        """Queue a job; `done` gets its result on the loop, called where the instance finished it,
        and the instance then starts the next job at once (one that `done` queued too: no loop
        iteration between one batch's answer and the next batch)."""
        self._jobs.append((requests, done))
        if self._idle:
            self._run(self._idle.pop())

    def _run(self, instance: ModelInstance) -> None:
        """Start the next job on `instance`, and the next while jobs finish as they start (a stub
        that is down answers at once); idle again when there is none."""
        while self._jobs:
            requests, done = self._jobs.popleft()
            self._busy += 1
            job = _Started(self, instance, done)
            try:
                instance.begin_execute(requests, job.finish)
            except Exception as exc:
                job.finish(raised(exc, len(requests)))
            job.starting = False
            if not job.finished:
                return  # it runs elsewhere: its finish goes on from there
        self._idle.append(instance)
        if not self._busy and self._stopped is not None:
            self._stopped.set()

    def _finished(self, job: _Started, results: list[ExecuteResult]) -> None:
        self._busy -= 1
        try:
            job.done(JobResult(results, job.picked, job.picked, time.perf_counter_ns()))
        except Exception as exc:  # the scheduler's bug: reported, the instance serves on
            asyncio.get_running_loop().call_exception_handler(
                {"message": "a finished job's callback raised", "exception": exc})
        if not job.starting:  # finished later, on the loop: the instance goes on from here
            self._run(job.instance)

    async def stop(self) -> None:
        """Let queued jobs finish, then close the instances (off the loop: a close may wait)."""
        if self._busy or self._jobs:
            self._stopped = asyncio.Event()
            await self._stopped.wait()
        loop = asyncio.get_running_loop()
        for instance in self._instances:
            await loop.run_in_executor(None, instance.close)


def instance_pool(instances: list[ModelInstance], name: str) -> InstancePool | LoopPool:
    """The pool for a model's instances: a LoopPool when they all await their executions."""
    if instances and all(inst.awaits_execute for inst in instances):
        return LoopPool(instances, name)
    return InstancePool(instances, name)
