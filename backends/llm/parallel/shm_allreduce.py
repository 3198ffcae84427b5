"""An all-reduce through one shared-memory segment, for ranks on one machine (vLLM's CPU backend has
one too: gloo's loopback TCP costs far more than the copies; bench/results/tensor_parallel.md).

Layout: a flag per rank (its own cache line: the number of all-reduces it has written), then two
areas of `size` slots (`capacity` bytes each). All-reduce number s: each rank copies its tensor into
slot [s % 2][rank], publishes s in its flag, waits for every flag to reach s, then sums the slots in
rank order, so every rank holds the same bits. Two areas are enough: a rank writes area s % 2 again
only at s + 2, after every rank has published s + 1, i.e. finished reading s.

The segment is a file in /dev/shm named for the server and the engine-core process that made it
(`pier-tp-<server pid>-<core pid>`); rank 0 removes the name as soon as every rank has mapped it, so
nothing is left there whatever happens later (a `kill -9` included), and removes, at its start, the
names of engine cores that died in the moment between. A rank that waits on a dead one fails (its
`dead` callable says so), and after TIMEOUT_S in any case.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pier.ipc.processes import PARENT_ENV

SHM = Path("/dev/shm")
PREFIX = "pier-tp-"
LINE = 64  # bytes: one flag per cache line
CAPACITY = 4 << 20  # bytes per slot; a larger all-reduce (a long prefill's) goes through gloo
TIMEOUT_S = 120.0


def segment_name() -> str:
    return f"{PREFIX}{os.environ.get(PARENT_ENV, '0')}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Remove the segments of engine cores (or servers) that are gone (named pier-tp-<server>-<core>)."""
    for path in SHM.glob(f"{PREFIX}*"):
        parts = path.name[len(PREFIX):].split("-")
        if len(parts) == 2 and all(p.isdigit() for p in parts) and not all(_alive(int(p)) for p in parts if p != "0"):
            path.unlink(missing_ok=True)


class ShmAllReduce:
    """Rank `rank` of `size` on the segment `name` (made by rank 0 with `create`)."""

    def __init__(self, name: str, rank: int, size: int, dead: Callable[[], bool], create: bool = False,
                 capacity: int = CAPACITY) -> None:
        self.name, self.rank, self.size, self.capacity, self.dead = name, rank, size, capacity, dead
        self.path = SHM / name
        total = LINE * size + 2 * size * capacity
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=LINE // 8 * size)[:: LINE // 8]
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=LINE * size, count=2 * size * capacity)
        self._slots = data.view(2, size, capacity)
        self._seq = 0

    def unlink(self) -> None:
        """Remove the name (every rank has mapped it: the memory stays theirs)."""
        self.path.unlink(missing_ok=True)

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.nbytes <= self.capacity and t.is_contiguous()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._seq += 1
        seq, area = self._seq, self._seq % 2
        n = t.nbytes
        slots = self._slots[area, :, :n].view(t.dtype).view(self.size, *t.shape)
        slots[self.rank].copy_(t)
        self._flags[self.rank] = seq
        self._wait(seq)
        if self.size == 2:
            torch.add(slots[0], slots[1], out=t)
        else:
            torch.sum(slots, dim=0, out=t)
        return t

    def _wait(self, seq: int) -> None:
        flags = self._flags
        spins = 0
        deadline = 0.0
        while int(flags.min()) < seq:
            spins += 1
            if spins < 256:
                continue
            os.sched_yield()
            if spins % 4096 == 0:
                if self.dead():
                    raise RuntimeError("shared-memory all-reduce: a rank of the group is gone")
                now = time.monotonic()
                deadline = deadline or now + TIMEOUT_S
                if now > deadline:
                    raise RuntimeError(f"shared-memory all-reduce: no answer from every rank in {TIMEOUT_S:g} s")

    def close(self) -> None:
        self._slots = torch.empty(0)
        self._flags = np.empty(0, dtype=np.int64)
        try:
            self._map.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass
