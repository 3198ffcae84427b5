"""Dynamic batcher, with a toy backend: batch assembly (preferred sizes, delay bound, max size,
shape compatibility), split-back under concurrency, priorities, queue limits, timeouts,
preserve_ordering."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from pier.contract.backend import ModelInstance
from pier.contract.errors import PierError
from pier.contract.policies import BatchingPolicy, QueuePolicy
from pier.contract.types import InferenceRequest, Outputs, Tensor
from pier.observability.statistics import ModelStatistics
from pier.scheduling.base import WorkItem
from pier.scheduling.dynamic_batcher import DynamicBatcher


class Recorder(ModelInstance):
    """OUT = IN * 2 + 1; records each batch (its first column) and can be held by a gate."""

    def __init__(self, gate: threading.Event | None = None, delay: float = 0.0) -> None:
        self.batches: list[list[float]] = []
        self.gate = gate
        self.delay = delay

    def execute(self, requests):
        (req,) = requests
        if self.gate is not None:
            self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        x = req.inputs[0].data
        self.batches.append(x[:, 0].tolist())
        y = x * 2 + 1
        return [Outputs([Tensor("OUT", "FP32", list(y.shape), y)])]


def request(value: float, rows: int = 1, width: int = 4, **params) -> WorkItem:
    x = np.full((rows, width), value, dtype=np.float32)
    req = InferenceRequest("toy", "", [Tensor("IN", "FP32", list(x.shape), x)], parameters=params)
    return WorkItem(req, rows)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _batcher(policy: BatchingPolicy, *instances: ModelInstance) -> tuple[DynamicBatcher, ModelStatistics]:
    stats = ModelStatistics()
    return DynamicBatcher(list(instances), stats, "toy", policy), stats


def test_split_back_under_concurrency():
    async def main():
        inst = Recorder(delay=0.002)
        b, stats = await _batcher(BatchingPolicy(max_batch_size=8, preferred_sizes=(8,), max_queue_delay_us=2000), inst)
        items = [request(float(i), rows=1 + i % 3) for i in range(60)]
        results = await asyncio.gather(*(b.enqueue(it) for it in items))
        for it, res in zip(items, results):
            x = it.request.inputs[0].data
            assert res.tensors[0].data.shape == x.shape
            np.testing.assert_array_equal(res.tensors[0].data, x * 2 + 1)
        await b.stop()
        assert stats.inference_count == sum(it.batch_size for it in items)
        assert stats.execution_count < len(items)  # requests really shared batches
        assert max(len(batch) for batch in inst.batches) > 1
        assert all(len(batch) <= 8 for batch in inst.batches)
    run(main())


def test_preferred_size_runs_without_waiting_for_the_delay():
    async def main():
        inst = Recorder()
        policy = BatchingPolicy(max_batch_size=8, preferred_sizes=(4,), max_queue_delay_us=5_000_000)
        b, _ = await _batcher(policy, inst)
        t0 = time.monotonic()
        await asyncio.gather(*(b.enqueue(request(float(i))) for i in range(4)))
        assert time.monotonic() - t0 < 2.0  # far below the 5 s delay
        assert inst.batches == [[0.0, 1.0, 2.0, 3.0]]
        await b.stop()
    run(main())


def test_preferred_prefix_runs_at_once_as_in_triton():
    """Triton's choice when the queue holds more than a preferred size: the prefix that is a
    preferred size runs at once, and so does the prefix just under the largest preferred size
    when the next request would overshoot it; the rest waits for the delay."""
    async def main():
        inst = Recorder()
        policy = BatchingPolicy(max_batch_size=8, preferred_sizes=(2, 4), max_queue_delay_us=400_000)
        b, _ = await _batcher(policy, inst)
        t0 = time.monotonic()
        done: list[float] = []

        async def timed(item: WorkItem) -> None:
            await b.enqueue(item)
            done.append(time.monotonic() - t0)

        await asyncio.gather(*(timed(request(float(i))) for i in range(3)))  # 1 + 1 + 1: a prefix of 2
        assert inst.batches == [[0.0, 1.0], [2.0]]
        assert done[0] < 0.2 <= 0.35 < done[2], done
        inst.batches.clear()
        done.clear()
        t0 = time.monotonic()
        await asyncio.gather(*(timed(request(float(i), rows=3)) for i in range(2)))  # 3 + 3 passes 4
        assert inst.batches == [[0.0] * 3, [1.0] * 3]
        assert done[0] < 0.2 <= 0.35 < done[1], done
        await b.stop()
    run(main())


def test_delay_bounds_the_wait_for_a_fuller_batch():
    async def main():
        inst = Recorder()
        policy = BatchingPolicy(max_batch_size=8, preferred_sizes=(8,), max_queue_delay_us=100_000)
        b, stats = await _batcher(policy, inst)
        t0 = time.monotonic()
        await asyncio.gather(*(b.enqueue(request(float(i))) for i in range(3)))
        elapsed = time.monotonic() - t0
        assert 0.08 <= elapsed < 2.0, elapsed
        assert inst.batches == [[0.0, 1.0, 2.0]]
        assert list(stats.batches) == [3]
        await b.stop()
    run(main())


def test_max_batch_size_and_shape_compatibility():
    async def main():
        gate = threading.Event()
        inst = Recorder(gate)
        b, _ = await _batcher(BatchingPolicy(max_batch_size=4, preferred_sizes=(4,)), inst)
        first = asyncio.ensure_future(b.enqueue(request(-1)))
        await asyncio.sleep(0.05)
        items = [request(float(i), width=4) for i in range(6)] + [request(9.0, width=5), request(10.0, width=4)]
        futs = [asyncio.ensure_future(b.enqueue(it)) for it in items]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(first, *futs)
        assert inst.batches == [[-1.0], [0.0, 1.0, 2.0, 3.0], [4.0, 5.0], [9.0], [10.0]]
        assert results[7].tensors[0].data.shape == (1, 5)
        await b.stop()
    run(main())


def test_priority_levels():
    async def main():
        gate = threading.Event()
        inst = Recorder(gate)
        policy = BatchingPolicy(max_batch_size=1, preferred_sizes=(1,), priority_levels=2, default_priority_level=2)
        b, _ = await _batcher(policy, inst)
        first = asyncio.ensure_future(b.enqueue(request(0)))
        await asyncio.sleep(0.05)
        low = [asyncio.ensure_future(b.enqueue(request(float(i)))) for i in (1, 2)]
        high = asyncio.ensure_future(b.enqueue(request(3.0, priority=1)))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, high, *low)
        assert inst.batches == [[0.0], [3.0], [1.0], [2.0]]
        # As Triton: a priority past the model's levels runs at the default level, not an error.
        gate.clear()
        first = asyncio.ensure_future(b.enqueue(request(0)))
        await asyncio.sleep(0.05)
        out_of_range = asyncio.ensure_future(b.enqueue(request(5.0, priority=3)))
        high = asyncio.ensure_future(b.enqueue(request(6.0, priority=1)))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(first, out_of_range, high)
        assert inst.batches[4:] == [[0.0], [6.0], [5.0]]
        await b.stop()
    run(main())


def test_full_queue_rejects_at_once():
    async def main():
        gate = threading.Event()
        inst = Recorder(gate)
        policy = BatchingPolicy(max_batch_size=1, default_policy=QueuePolicy(max_queue_size=2))
        b, stats = await _batcher(policy, inst)
        running = asyncio.ensure_future(b.enqueue(request(0)))
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(b.enqueue(request(float(i)))) for i in (1, 2)]
        await asyncio.sleep(0.01)
        with pytest.raises(PierError) as err:
            await b.enqueue(request(3.0))
        assert err.value.code.name == "UNAVAILABLE"
        assert err.value.message == "[request id: <id_unknown>] Exceeds maximum queue size"  # as Triton
        assert stats.failures["REJECTED"] == 1
        gate.set()
        await asyncio.gather(running, *queued)
        await b.stop()
    run(main())


def test_timeouts_reject_delay_and_override():
    async def main():
        gate = threading.Event()
        inst = Recorder(gate)
        policy = BatchingPolicy(max_batch_size=1, priority_levels=2, default_priority_level=2,
                                default_policy=QueuePolicy(default_timeout_us=50_000, allow_timeout_override=True),
                                level_policies={1: QueuePolicy(default_timeout_us=50_000, timeout_action_delay=True)})
        b, stats = await _batcher(policy, inst)
        running = asyncio.ensure_future(b.enqueue(request(0)))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        rejected = asyncio.ensure_future(b.enqueue(request(1.0)))
        delayed = asyncio.ensure_future(b.enqueue(request(2.0, priority=1)))
        short = asyncio.ensure_future(b.enqueue(request(3.0, timeout=10_000)))
        result = await rejected
        assert isinstance(result, PierError) and "Request timeout expired" in result.message
        assert time.monotonic() - t0 < 2.0
        assert isinstance(await short, PierError)
        late = asyncio.ensure_future(b.enqueue(request(4.0, priority=1, timeout=0)))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(running, delayed, late)
        assert inst.batches == [[0.0], [4.0], [2.0]]  # the timed-out DELAY request runs last
        assert stats.failures["REJECTED"] == 2
        await b.stop()
    run(main())


def test_delayed_requests_stay_within_their_level():
    """As Triton (a delayed queue per level; qa/L0_model_queue test_priority_with_policy): a
    request that timed out with action DELAY runs after its own level's requests still in time,
    but before every request of a lower level."""
    async def main():
        gate = threading.Event()
        inst = Recorder(gate)
        policy = BatchingPolicy(max_batch_size=1, priority_levels=2, default_priority_level=2,
                                level_policies={1: QueuePolicy(default_timeout_us=30_000, timeout_action_delay=True)})
        b, _ = await _batcher(policy, inst)
        running = asyncio.ensure_future(b.enqueue(request(0)))
        await asyncio.sleep(0.05)
        delayed = asyncio.ensure_future(b.enqueue(request(1.0, priority=1)))
        low = asyncio.ensure_future(b.enqueue(request(2.0, priority=2)))
        await asyncio.sleep(0.1)  # `delayed` times out: it moves behind level 1's in-time requests
        in_time = asyncio.ensure_future(b.enqueue(request(3.0, priority=1, timeout=0)))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(running, delayed, low, in_time)
        assert inst.batches == [[0.0], [3.0], [1.0], [2.0]]
        await b.stop()
    run(main())


def test_max_queue_size_counts_delayed_requests():
    """As Triton: a level's bound covers its delayed requests too (they were never bounded)."""
    async def main():
        gate = threading.Event()
        inst = Recorder(gate)
        policy = BatchingPolicy(max_batch_size=1, default_policy=QueuePolicy(
            default_timeout_us=20_000, timeout_action_delay=True, max_queue_size=1))
        b, stats = await _batcher(policy, inst)
        running = asyncio.ensure_future(b.enqueue(request(0)))
        await asyncio.sleep(0.05)
        delayed = asyncio.ensure_future(b.enqueue(request(1.0)))
        await asyncio.sleep(0.1)  # timed out: delayed, still queued
        assert b.pending_count() == 1
        with pytest.raises(PierError) as err:
            await b.enqueue(request(2.0))
        assert err.value.message == "[request id: <id_unknown>] Exceeds maximum queue size"
        assert stats.failures["REJECTED"] == 1
        gate.set()
        await asyncio.gather(running, delayed)
        assert inst.batches == [[0.0], [1.0]]
        await b.stop()
    run(main())


def test_priority_levels_cost_nothing_until_used():
    """qa/L0_model_queue test_max_priority_levels: priority_levels may be as large as uint64
    (here with a default level past 2^32). Queues exist only for the levels holding requests
    (allocating one per level ran the server out of memory), and emptied levels are forgotten."""
    async def main():
        gate = threading.Event()
        inst = Recorder(gate)
        levels = 2**64 - 1
        policy = BatchingPolicy(max_batch_size=1, priority_levels=levels, default_priority_level=2**32)
        b, _ = await _batcher(policy, inst)
        running = asyncio.ensure_future(b.enqueue(request(0)))
        await asyncio.sleep(0.05)
        waiting = [asyncio.ensure_future(b.enqueue(request(float(i), priority=p)))
                   for i, p in ((1, levels), (2, 0), (3, 2**32 + 1), (4, 1), (5, 7))]
        await asyncio.sleep(0.01)
        assert b.pending_count() == 5
        gate.set()
        await asyncio.gather(running, *waiting)
        # priority 0 takes the default level 2^32; the rest run at their own level, highest first
        assert inst.batches == [[0.0], [4.0], [5.0], [2.0], [3.0], [1.0]]
        assert b.pending_count() == 0 and len(b._levels) <= 1
        await b.stop()
    run(main())


def test_timeout_override_only_shortens_a_default():
    """As Triton: with no default timeout there is nothing to shorten, so a request's own timeout
    is ignored even when the policy allows overrides."""
    async def main():
        gate = threading.Event()
        inst = Recorder(gate)
        policy = BatchingPolicy(max_batch_size=1, default_policy=QueuePolicy(allow_timeout_override=True))
        b, stats = await _batcher(policy, inst)
        running = asyncio.ensure_future(b.enqueue(request(0)))
        await asyncio.sleep(0.05)
        patient = asyncio.ensure_future(b.enqueue(request(1.0, timeout=10_000)))
        await asyncio.sleep(0.1)  # ten times its timeout
        gate.set()
        results = await asyncio.gather(running, patient)
        assert not any(isinstance(r, PierError) for r in results) and inst.batches == [[0.0], [1.0]]
        assert not any(stats.failures.values())
        await b.stop()
    run(main())


def test_preserve_ordering_across_instances():
    async def main():
        slow, fast = Recorder(delay=0.3), Recorder()
        policy = BatchingPolicy(max_batch_size=1, preserve_ordering=True)
        b, _ = await _batcher(policy, slow, fast)
        done: list[int] = []

        async def one(i: int) -> None:
            await b.enqueue(request(float(i)))
            done.append(i)

        await asyncio.gather(*(one(i) for i in range(4)))
        assert done == sorted(done)
        await b.stop()
    run(main())


class Rendezvous(Recorder):
    """Both instances must be inside execute at the same time, or the barrier breaks."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier

    def execute(self, requests):
        self.barrier.wait(5)
        return super().execute(requests)


def test_instances_execute_concurrently_from_one_queue():
    async def main():
        barrier = threading.Barrier(2)
        a, b_ = Rendezvous(barrier), Rendezvous(barrier)
        b, _ = await _batcher(BatchingPolicy(max_batch_size=1), a, b_)
        results = await asyncio.gather(*(b.enqueue(request(float(i))) for i in range(4)))
        assert len(results) == 4 and not barrier.broken
        assert len(a.batches) == 2 and len(b_.batches) == 2
        await b.stop()
    run(main())
