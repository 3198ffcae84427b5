"""The scheduler interface every scheduler implements: enqueue, inflight_count, pending_count, stop."""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pier.contract.backend import ModelInstance
from pier.contract.errors import PierError, internal
from pier.contract.types import ExecuteResult, InferenceRequest


@dataclass(slots=True)
class WorkItem:
    """A validated request waiting to run. `batch_size` is its dim-0 size (1 if unbatched)."""

    request: InferenceRequest
    batch_size: int
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


@dataclass(slots=True)
class ExecutionTiming:
    start_ns: int
    end_ns: int


class Scheduler(abc.ABC):
    @abc.abstractmethod
    async def enqueue(self, item: WorkItem) -> ExecuteResult:
        """Run `item` (when and with what is the scheduler's choice); return its result."""

    @abc.abstractmethod
    def inflight_count(self) -> int:
        """Requests accepted and not yet answered."""

    @abc.abstractmethod
    def pending_count(self) -> int:
        """Requests queued and not yet executing (nv_inference_pending_request_count)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Wait for in-flight work to finish, then release the instances."""

    def instance_lost(self, index: int) -> None:  # noqa: B027 - only schedulers keeping something per instance act
        """Instance `index` (of those this scheduler runs, in order) lost what it held: its process
        died (it is restarting). Nothing to do for schedulers that keep nothing per instance."""


def execute_timed(
    instance: ModelInstance, requests: Sequence[InferenceRequest]
) -> tuple[list[ExecuteResult], ExecutionTiming]:
    """Run on a worker thread: execute and time it."""
    start = time.perf_counter_ns()
    try:
        results = instance.execute(requests)
    except Exception as exc:
        results = raised(exc, len(requests))
    return results, ExecutionTiming(start, time.perf_counter_ns())


def raised(exc: Exception, count: int) -> list[ExecuteResult]:
    """The results of `count` requests whose backend raised `exc`: a backend bug fails its own
    requests, nothing else."""
    if isinstance(exc, PierError):
        return [exc] * count
    return [internal(f"backend error: {type(exc).__name__}: {exc}")] * count
