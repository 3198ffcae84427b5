"""Triton's dynamic batcher: queued requests with compatible shapes are merged along dim 0 and
run as one batch on the next idle instance.

When an instance is idle, the batcher takes requests in priority order (then arrival order),
stopping at the first one that does not fit (incompatible shapes, or past max_batch_size).
It runs at once a prefix of preferred size (or, when the queue holds more than the largest
preferred size, the prefix that stays under it), a batch that cannot grow, or whatever is
queued once the oldest request has waited max_queue_delay_microseconds (see _next_batch).
With a BatchLayout (ragged batching, see ragged.py), ragged inputs take no part in shape
compatibility, the batch gets its batch inputs, and batch outputs are scattered back.
Per-level queue policies bound the queue (a full queue rejects at once with UNAVAILABLE) and
time requests out (REJECT fails them, DELAY moves them behind the requests of their level still
in time, as Triton's per-level delayed queues). A level's queues exist only while they hold
requests, so any number of priority levels costs nothing until used.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pier.contract.backend import ModelInstance
from pier.contract.errors import PierError, internal, unavailable
from pier.contract.policies import BatchingPolicy, QueuePolicy
from pier.contract.types import ExecuteResult
from pier.observability.statistics import ModelStatistics
from pier.scheduling.base import Scheduler, WorkItem
from pier.scheduling.batch import CompatKey, compat_key, merge, split
from pier.scheduling.instance_pool import JobResult, instance_pool
from pier.scheduling.ragged import BatchLayout
from pier.tensors.validation import request_prefix


@dataclass(slots=True, eq=False)
class _Pending:
    item: WorkItem
    future: asyncio.Future
    key: CompatKey
    level: int
    deadline_ns: int | None
    ready_ns: int  # when it reached the batcher: max_queue_delay counts from here (a sequence's
    # request may have waited for its predecessor long before; its queue time still counts that)


@dataclass(slots=True, eq=False)
class _Level:
    """One priority level's requests: in arrival order, then those that timed out with action
    DELAY (behind every request of the level still in time)."""

    queue: deque[_Pending] = field(default_factory=deque)
    delayed: deque[_Pending] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self.queue) + len(self.delayed)


class DynamicBatcher(Scheduler):
    def __init__(self, instances: list[ModelInstance], stats: ModelStatistics, name: str,
                 policy: BatchingPolicy, layout: BatchLayout | None = None) -> None:
        """`layout`: the model's ragged inputs and batch inputs/outputs (None: plain batching)."""
        self._pool = instance_pool(instances, name)
        self._idle = self._pool.size
        self._stats = stats
        self._policy = policy
        self._layout = layout
        self._levels: dict[int, _Level] = {}  # only the levels holding requests (and a lone emptied one)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: int | None = None
        self._executing = 0
        self._stopping = False
        self._drained = asyncio.Event()
        self._next_seq = 0
        self._deliver_seq = 0
        self._finished: dict[int, tuple[list[_Pending], list[ExecuteResult]]] = {}
        # Fixed per policy, read on every request: skip the timeout pass when no level can time out.
        self._timeouts = any(q.default_timeout_us or q.allow_timeout_override
                             for q in (policy.default_policy, *policy.level_policies.values()))
        self._ragged = layout.ragged_inputs if layout is not None else frozenset()

    # ---- enqueue -------------------------------------------------------------------------

    def _level_of(self, item: WorkItem) -> int:
        p = self._policy
        if p.priority_levels <= 0:
            return 1
        requested = item.request.parameters.get("priority", 0)
        if not requested or requested > p.priority_levels:  # as Triton: 0 or out of range -> the default
            return p.default_priority_level or p.priority_levels
        return requested

    def _deadline(self, item: WorkItem, policy: QueuePolicy) -> int | None:
        timeout = policy.default_timeout_us
        requested = item.request.parameters.get("timeout", 0)
        if policy.allow_timeout_override and requested and timeout:  # as Triton: only shortens a default
            timeout = min(timeout, requested)
        return item.enqueued_ns + timeout * 1000 if timeout else None

    async def enqueue(self, item: WorkItem) -> ExecuteResult:
        if self._stopping:
            raise unavailable("model is unloading: no new requests are accepted")
        level = self._level_of(item)
        policy = self._policy.policy(level)
        queue = self._levels.get(level)
        if policy.max_queue_size and queue is not None and len(queue) >= policy.max_queue_size:
            self._stats.record_request(False, 0, reason="REJECTED")
            raise unavailable(request_prefix(item.request) + "Exceeds maximum queue size")
        if queue is None:
            queue = self._levels[level] = _Level()
        future = asyncio.get_running_loop().create_future()
        key = compat_key(item.request, self._ragged)
        deadline = self._deadline(item, policy) if self._timeouts else None
        queue.queue.append(_Pending(item, future, key, level, deadline, time.perf_counter_ns()))
        self._schedule()
        return await future  # already done when the batch ran inline: no suspension

    def inflight_count(self) -> int:
        return self.pending_count() + self._executing

    def pending_count(self) -> int:
        return sum(map(len, self._levels.values()))

    def _prune(self) -> None:
        """Forget the levels left empty (a lone level stays: the common one-level model keeps its queues)."""
        if len(self._levels) > 1 and any(not q for q in self._levels.values()):
            self._levels = {n: q for n, q in self._levels.items() if q}

    # ---- the batching loop ---------------------------------------------------------------

    def _schedule(self) -> None:
        """Run on every arrival, completion and timer: apply timeouts, then start batches while
        an instance is idle. Synchronous, so a request that can run at once starts in the same
        loop iteration it arrived in."""
        now = time.perf_counter_ns()
        next_wake = self._expire(now) if self._timeouts else None
        while self._idle > 0:
            batch, wait_until = self._next_batch(now)
            if not batch:
                if wait_until is not None:
                    next_wake = wait_until if next_wake is None else min(next_wake, wait_until)
                break
            if self._dispatch(batch):  # ran inline: time has passed
                now = time.perf_counter_ns()
        if self._stopping and not self.pending_count() and not self._executing:
            self._drained.set()
        self._arm(next_wake, now)

    def _arm(self, when_ns: int | None, now: int) -> None:
        if when_ns == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, when_ns
        if when_ns is not None:
            # uvloop fires sub-millisecond timers on the next loop iteration, so short queue
            # delays are honoured to the microsecond (at the cost of re-checking each iteration).
            self._timer = asyncio.get_running_loop().call_later(max(when_ns - now, 0) / 1e9, self._on_timer)

    def _on_timer(self) -> None:
        # Every arrival and completion runs _schedule itself, so a timer that fires early (uvloop
        # rounds sub-millisecond delays down to the next iteration) has nothing new to look at:
        # re-arm it without a full pass. This keeps the short waits precise and cheap.
        at = self._timer_at
        if at is not None:
            now = time.perf_counter_ns()
            if now < at:
                self._timer = asyncio.get_running_loop().call_later((at - now) / 1e9, self._on_timer)
                return
        self._timer = self._timer_at = None
        self._schedule()

    def _expire(self, now: int) -> int | None:
        """Apply timeouts; return the next deadline still ahead."""
        next_deadline = None
        for level in self._levels.values():
            queue = level.queue
            if not any(p.deadline_ns is not None for p in queue):
                continue
            keep: deque[_Pending] = deque()
            for p in queue:
                if p.deadline_ns is not None and p.deadline_ns <= now:
                    if self._policy.policy(p.level).timeout_action_delay:
                        p.deadline_ns = None
                        level.delayed.append(p)
                    else:
                        self._stats.record_request(False, now - p.item.enqueued_ns, reason="REJECTED")
                        if not p.future.done():
                            p.future.set_result(unavailable("Request timeout expired"))
                    continue
                if p.deadline_ns is not None:
                    next_deadline = p.deadline_ns if next_deadline is None else min(next_deadline, p.deadline_ns)
                keep.append(p)
            queue.clear()
            queue.extend(keep)
        self._prune()
        return next_deadline

    def _ordered(self) -> Iterator[_Pending]:
        for queue in self._deques():
            yield from queue

    def _next_batch(self, now: int) -> tuple[list[_Pending], int | None]:
        """The batch to run now, or ([], when to look again). Triton's rules: walk the queue while
        requests fit (compatible shapes, within max_batch_size), remembering the longest prefix
        that is a preferred size, or else the prefix just before the total would pass the
        largest preferred size. Within the queue delay that prefix runs at once; a batch that
        cannot grow (something did not fit, or it reached the largest preferred size) runs
        whole; otherwise wait for the oldest request's delay."""
        p = self._policy
        max_size = p.max_batch_size
        preferred = p.preferred_sizes
        max_preferred = max(preferred) if preferred else max_size
        candidate: list[_Pending] = []
        total = best = 0
        send_now = False
        key = None
        if len(self._levels) == 1 and not (only := next(iter(self._levels.values()))).delayed:
            ordered: Iterable[_Pending] = only.queue
        else:
            ordered = self._ordered()
        for pending in ordered:
            if pending.future.done():  # cancelled by its client while queued
                continue
            size = pending.item.batch_size
            if candidate:
                if not best and total + size > max_preferred:
                    best = len(candidate)
                if total + size > max_size or pending.key != key:
                    send_now = True
                    break
            else:
                key = pending.key
            candidate.append(pending)
            total += size
            if total in preferred:
                best = len(candidate)
            if total >= max_size:  # nothing more can join (the next request would stop the walk)
                send_now = True
                break
        if not candidate:
            if self.pending_count():
                self._drop_done()
            return [], None
        deadline = candidate[0].ready_ns + p.max_queue_delay_us * 1000
        waited_out = p.max_queue_delay_us > 0 and now >= deadline
        if best and not waited_out:
            return self._take(candidate[:best]), None
        if send_now or total >= max_preferred or now >= deadline:
            return self._take(candidate), None
        return [], deadline

    def _take(self, batch: list[_Pending]) -> list[_Pending]:
        """Remove `batch` from the queues. It is a prefix of `_ordered()` once the cancelled
        requests `_next_batch` skipped are left out, so pop from the fronts and put those back."""
        i, n = 0, len(batch)
        for queue in self._deques():
            skipped: list[_Pending] = []
            while i < n and queue:
                p = queue.popleft()
                if p is batch[i]:
                    i += 1
                else:
                    skipped.append(p)
            if skipped:
                queue.extendleft(reversed(skipped))
            if i == n:
                break
        self._prune()
        return batch

    def _deques(self) -> Iterator[deque[_Pending]]:
        """Every queue in the order requests are taken: highest priority (lowest level) first."""
        for n in sorted(self._levels):
            level = self._levels[n]
            yield level.queue
            yield level.delayed

    def _drop_done(self) -> None:
        for queue in self._deques():
            if any(p.future.done() for p in queue):
                kept = [p for p in queue if not p.future.done()]
                queue.clear()
                queue.extend(kept)
        self._prune()

    # ---- execution -----------------------------------------------------------------------

    def _dispatch(self, batch: list[_Pending]) -> bool:
        """Start `batch`; True when it already finished (ran inline, or could not be formed)."""
        self._idle -= 1
        self._executing += len(batch)
        seq = self._next_seq
        self._next_seq += 1
        try:
            requests = [p.item.request for p in batch]
            job_requests = requests if self._pool.unbatched else [merge(requests, self._layout)]
            job = self._pool.run_inline(job_requests)
        except Exception as exc:  # the batch cannot be formed: fail its requests, nothing else
            err = exc if isinstance(exc, PierError) else internal(f"cannot form the batch: {exc}")
            now = time.perf_counter_ns()
            job = JobResult([err], now, now, now)
        if job is not None:
            self._complete(seq, batch, job)
            return True
        self._pool.start(job_requests, lambda job: self._on_done(seq, batch, job))
        return False

    def _on_done(self, seq: int, batch: list[_Pending], job: JobResult) -> None:
        self._complete(seq, batch, job)
        self._schedule()

    def _complete(self, seq: int, batch: list[_Pending], job: JobResult) -> None:
        """Account for a finished batch and answer its requests (in order, if preserved)."""
        self._idle += 1
        self._executing -= len(batch)
        sizes = [p.item.batch_size for p in batch]
        results: list[ExecuteResult]
        if self._pool.unbatched and len(job.results) == len(batch):
            results = list(job.results)
        elif self._pool.unbatched or len(job.results) != 1:
            expected = len(batch) if self._pool.unbatched else 1
            results = [internal(f"backend returned {len(job.results)} results for {expected}")] * len(batch)
        else:
            results = split(job.results[0], sizes, [p.item.request for p in batch], self._layout)
        done = time.perf_counter_ns()
        input_ns = job.start_ns - job.picked_ns
        infer_ns = job.end_ns - job.start_ns
        output_ns = done - job.end_ns
        succeeded = sum(size for size, result in zip(sizes, results) if not isinstance(result, Exception))
        self._stats.record_execution(sum(sizes), input_ns, infer_ns, output_ns, succeeded)
        for p, result in zip(batch, results):
            ok = not isinstance(result, Exception)
            self._stats.record_request(ok, done - p.item.enqueued_ns, job.picked_ns - p.item.enqueued_ns,
                                       input_ns, infer_ns, output_ns, reason=None if ok else "BACKEND")
            if p.item.request.trace:
                p.item.request.trace.compute(job.picked_ns, job.start_ns, job.end_ns, done)
        if self._policy.preserve_ordering:
            self._finished[seq] = (batch, results)
            while self._deliver_seq in self._finished:
                self._deliver(*self._finished.pop(self._deliver_seq))
                self._deliver_seq += 1
        else:
            self._deliver(batch, results)

    @staticmethod
    def _deliver(batch: list[_Pending], results: list[ExecuteResult]) -> None:
        for p, result in zip(batch, results):
            if not p.future.done():
                p.future.set_result(result)

    async def stop(self) -> None:
        """Run what is queued, then stop the instances."""
        self._stopping = True
        self._schedule()
        await self._drained.wait()
        if self._timer is not None:
            self._timer.cancel()
        await self._pool.stop()
