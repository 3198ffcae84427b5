"""Triton's sequence slots: each instance of a stateful model holds a fixed number of sequences at
once (`SequencePolicy.slots`: the max batch size, or the oldest strategy's max_candidate_sequences),
and a sequence keeps the slot it was given at START for its life, so that every request of it runs
on that instance (Triton's promise: "all inference requests in a sequence get routed to the same
model instance so that the model can maintain state correctly").

A free slot goes to the sequence that has waited longest for one (Triton's backlog); with none
waiting, the lowest-numbered free slot is given next (slot 0 of each instance, then slot 1, ...),
which spreads new sequences over the instances as Triton's ready-slot queue does.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque

from pier.contract.errors import PierError

Slot = tuple[int, int]  # (slot within its instance, instance): ordered as slots are handed out


class SequenceSlots:
    """The free slots and the backlog of sequences waiting for one. Event loop only."""

    def __init__(self, instances: int, per_instance: int) -> None:
        self._free: list[Slot] = [(slot, instance) for slot in range(per_instance) for instance in range(instances)]
        heapq.heapify(self._free)
        self._backlog: deque[asyncio.Future[Slot]] = deque()
        self._closed: PierError | None = None

    def waiting(self) -> int:
        """Sequences waiting for a slot."""
        return sum(1 for fut in self._backlog if not fut.done())

    async def acquire(self) -> Slot:
        """A slot, at once when one is free and nobody waits, else when one is released to this
        caller (raises the error `close` was given; a caller cancelled meanwhile gives its slot on)."""
        if self._closed is not None:
            raise self._closed
        if self._free and not self._backlog:
            return heapq.heappop(self._free)
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._backlog.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:  # handed a slot as it went
                self.release(fut.result())
            raise

    def release(self, slot: Slot) -> None:
        """`slot` is free: to the longest-waiting sequence, or back among the free ones."""
        while self._backlog:
            fut = self._backlog.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        heapq.heappush(self._free, slot)

    def close(self, error: PierError) -> None:
        """No more slots (the model unloads): every sequence waiting for one, and every later
        `acquire`, fails with `error`."""
        self._closed = error
        while self._backlog:
            fut = self._backlog.popleft()
            if not fut.done():
                fut.set_exception(error)
