"""Instance pool: jobs run on the instances' worker threads; tiny executions move inline onto
the event loop after a warm-up, slow ones never do; an instance never runs two jobs at once."""

from __future__ import annotations

import asyncio
import threading
import time

from pier.contract.backend import ModelInstance
from pier.contract.types import Outputs
from pier.scheduling.instance_pool import INLINE_BELOW_NS, InstancePool, LoopPool, instance_pool


class ThreadRecorder(ModelInstance):
    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.threads: list[str] = []
        self.active = 0
        self.max_active = 0

    def execute(self, requests):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.threads.append(threading.current_thread().name)
        if self.seconds:
            time.sleep(self.seconds)
        self.active -= 1
        return [Outputs([]) for _ in requests]


def test_tiny_executions_move_inline_and_slow_ones_do_not():
    async def main():
        fast, slow = ThreadRecorder(), ThreadRecorder(seconds=2 * INLINE_BELOW_NS / 1e9)
        fast_pool, slow_pool = InstancePool([fast], "fast"), InstancePool([slow], "slow")
        for _ in range(60):
            await fast_pool.submit([None])
            await slow_pool.submit([None])
        main_thread = threading.current_thread().name
        assert fast.threads[0] != main_thread  # the warm-up ran on the worker
        assert fast.threads[-1] == main_thread  # then inline
        assert main_thread not in slow.threads
        await asyncio.gather(*(fast_pool.submit([None]) for _ in range(50)))
        assert fast.max_active == 1
        await fast_pool.stop()
        await slow_pool.stop()
    asyncio.run(main())


class Awaiting(ModelInstance):
    """Runs its batches 'elsewhere' and finishes them on the loop later, as a stub process's instance does."""

    awaits_execute = True

    def __init__(self, log: list[object], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail = log, name, fail
        self.active = self.max_active = 0
        self.closed_on: str | None = None

    def execute(self, requests):
        raise AssertionError("the pool calls begin_execute")

    def begin_execute(self, requests, finish):
        if self.fail:
            raise RuntimeError("broken backend")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.log.append((self.name, requests[0]))

        def answer():
            self.active -= 1
            finish([Outputs([]) for _ in requests])
        asyncio.get_running_loop().call_later(0.01, answer)

    def close(self):
        self.closed_on = threading.current_thread().name


def test_instances_that_run_elsewhere_are_started_on_the_loop_one_job_each_in_arrival_order():
    async def main():
        log: list[tuple[str, object]] = []
        a, b = Awaiting(log, "a"), Awaiting(log, "b")
        pool = instance_pool([a, b], "m")
        assert isinstance(pool, LoopPool) and pool.size == 2
        threads = threading.active_count()
        futures = [pool.submit([i]) for i in range(6)]
        assert pool.queued() == 4  # one started on each instance at once, the others wait
        jobs = await asyncio.gather(*futures)
        assert threading.active_count() == threads  # no worker thread
        assert [job_id for _, job_id in log] == list(range(6))  # taken in arrival order
        assert {name for name, _ in log} == {"a", "b"}  # both instances worked
        assert a.max_active == b.max_active == 1  # never two jobs at once on one instance
        assert all(job.picked_ns <= job.end_ns and len(job.results) == 1 for job in jobs)
        assert pool.queued() == 0
        await pool.stop()
        assert a.closed_on and b.closed_on and a.closed_on != threading.current_thread().name
    asyncio.run(main())


def test_an_execution_that_raises_fails_only_its_own_requests():
    async def main():
        log: list[tuple[str, object]] = []
        pool = instance_pool([Awaiting(log, "a", fail=True)], "m")
        job = await pool.submit([1, 2])
        assert [str(r) for r in job.results] == ["backend error: RuntimeError: broken backend"] * 2
        pool._instances[0].fail = False
        assert isinstance((await pool.submit([3])).results[0], Outputs)  # the instance serves on
        await pool.stop()
    asyncio.run(main())


def test_a_pool_with_threads_for_instances_that_block():
    async def main():
        pool = instance_pool([ThreadRecorder()], "m")
        assert isinstance(pool, InstancePool)
        await pool.stop()
    asyncio.run(main())


def test_the_job_a_finished_jobs_callback_queues_starts_with_no_loop_iteration_between():
    """The dynamic batcher forms its next batch in the callback of the one that ended: that batch
    goes to the stub at once, not after the responses written meanwhile."""
    async def main():
        order: list[object] = []
        pool = instance_pool([Awaiting(order, "a")], "m")
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def first_done(job):
            order.append("first done")
            loop.call_soon(order.append, "next loop iteration")
            pool.start([2], finished.set_result)

        pool.start([1], first_done)
        await finished
        assert order[:4] == [("a", 1), "first done", ("a", 2), "next loop iteration"]
        await pool.stop()
    asyncio.run(main())


def test_queued_jobs_an_instance_finishes_as_it_starts_them_run_without_recursion():
    """A stub that is down answers each batch at once: thousands queued behind a slow one all get
    their answer, in order, without one call nesting in the previous one's."""
    class GoesDown(ModelInstance):
        awaits_execute = True
        calls = 0

        def execute(self, requests):
            raise AssertionError

        def begin_execute(self, requests, finish):
            self.calls += 1
            if self.calls == 1:
                asyncio.get_running_loop().call_later(0.01, finish, [Outputs([])])
            else:
                finish([RuntimeError(f"down {requests[0]}")])

    async def main():
        pool = instance_pool([GoesDown()], "m")
        futures = [pool.submit([i]) for i in range(5000)]
        jobs = await asyncio.gather(*futures)
        assert isinstance(jobs[0].results[0], Outputs)
        assert [str(job.results[0]) for job in jobs[1:]] == [f"down {i}" for i in range(1, 5000)]
        await pool.stop()
    asyncio.run(main())
