"""One rank's tensor-parallel group: torch.distributed's process group and the collectives the
sharded layers call (`all_reduce` after a row-parallel projection and the vocabulary-parallel
embedding, `all_gather` of the LM head's logits).

The group is made before the model (the layers keep its bound methods) and joined after every rank
has loaded its shard (`join`): rank 0 hosts the rendezvous (a TCPStore on loopback, or torch's env://
settings for several machines, docs/llm.md). The backend is gloo on CPU, NCCL on CUDA. On CPU an
all-reduce small enough for the shared-memory area (shm_allreduce.py) goes through it instead of gloo
(both sum in rank order, so every rank holds the same bits).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

# how long a collective waits for a rank before it fails (a dead rank is seen sooner: its socket closes)
TIMEOUT_S = 120.0


class ParallelGroup:
    """Rank `rank` of `size`; `device` decides the backend (NCCL on CUDA, gloo elsewhere)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.shm: Any | None = None  # shm_allreduce.ShmAllReduce, where it serves

    @property
    def first(self) -> bool:
        return self.rank == 0

    def join(self, store: dist.Store | None, loopback: bool = True, timeout_s: float = TIMEOUT_S) -> None:
        """Join the process group through `store` (None: torch's env:// settings, MASTER_ADDR etc.);
        `loopback`: every rank is on this machine (gloo's sockets on lo, unless GLOO_SOCKET_IFNAME says)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.backend == "gloo" and store is not None and loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the store is on loopback: so are the ranks
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        if store is None:
            dist.init_process_group(self.backend, rank=self.rank, world_size=self.size, timeout=timeout)
        else:  # under the prefix env:// uses (init_process_group adds it for an init_method, not for a
            # store given), so that ranks joining through env:// (other machines') meet these in one store
            dist.init_process_group(self.backend, store=dist.PrefixStore("default_pg", store), rank=self.rank,
                                    world_size=self.size, timeout=timeout)

    def leave(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t` (in place where it can: use the returned tensor)."""
        shm = self.shm
        if shm is not None and shm.fits(t):
            return shm.all_reduce(t)  # type: ignore[no-any-return]
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's [M, n] `t` side by side: [M, size * n], rank 0's first."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=1)
