"""Instance pool: jobs run on the instances' worker threads; tiny executions move inline onto
the event loop after a warm-up, slow ones never do; an instance never runs two jobs at once."""

from __future__ import annotations

import asyncio
import threading
import time

from pier.contract.backend import ModelInstance
from pier.contract.types import Outputs
from pier.scheduling.instance_pool import INLINE_BELOW_NS, InstancePool


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
