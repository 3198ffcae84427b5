"""Rank 0 of a tensor-parallel group: in the engine-core process, beside the scheduler (which stays in
one place), it starts ranks 1..N-1 as children under pier.ipc.Supervisor, and each step ships them the
step's delta (delta.py) before running its own shard of the same step.

A rank that dies (any cause: `kill -9`, an error it said before it exited) ends the group: the
supervisor sees it at once (its pidfd) and `failure` names it ("tensor-parallel rank 1 of 2 (pid 12)
killed by signal 9 (SIGKILL)"); rank 0's collective with it fails (its socket closes), the engine core
fails the in-flight requests with that message and exits, and the server restarts the engine core,
which starts the whole group anew (core_client.py's restart budget). Ranks are not restarted one by
one: a new rank cannot join a process group mid-flight.

Rendezvous: a TCPStore rank 0 hosts on loopback (a free port). The sockets to the workers are ZeroMQ
ipc:// files in the engine core's own folder (the server's scratch folder: removed with it).

Several machines (`nnodes` > 1): rank 0 starts the ranks of its own machine as above and waits for
the others (remote.py: each a `pier tp-worker` that joins over TCP); the store is then on
master_port (the workers' env:// rendezvous), and the all-reduce is gloo's (or NCCL's) alone.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch.distributed as dist
import zmq

from pier.contract.backend import LoadProgress
from pier.ipc.child import Child, Exit, Launch, RestartPolicy, drop_scratch, scratch_folder
from pier.ipc.messages import BadMessage, encode
from pier.ipc.supervisor import Readers, Supervisor

from ..config import EngineConfig
from ..lora import LoRAOp
from ..model_runner import ModelRunner
from ..outputs import ModelRunnerOutput
from ..scheduler_output import GrammarBitmask, SchedulerOutput
from .delta import Shipper
from .group import TIMEOUT_S, ParallelGroup
from .messages import FROM_WORKER, Shutdown, WorkerFailed, WorkerInit, WorkerReady
from .remote import RemoteRanks
from .shm_allreduce import ShmAllReduce, remove_stale, segment_name

log = logging.getLogger("pier.llm")

STOP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 600.0
WAIT_SAID_S = 30.0
_NO_RESTART = RestartPolicy(0, 1.0)  # the group restarts as one (the engine core), never a rank alone


class RankFailed(RuntimeError):
    """A rank of the group died: the engine cannot step any more."""


class _Link:
    """Rank 0's two sockets to one worker: steps out (PUSH), events in (PULL)."""

    def __init__(self, ctx: zmq.Context, folder: str, rank: int) -> None:
        self.lock = threading.Lock()  # the steps socket: the engine's thread and the supervisor's
        self.steps = ctx.socket(zmq.PUSH)
        self.steps.setsockopt(zmq.LINGER, 0)
        self.steps.setsockopt(zmq.SNDHWM, 0)
        self.events = ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.LINGER, 0)
        self.addresses = f"ipc://{folder}/tp-{os.getpid()}-{rank}-steps", f"ipc://{folder}/tp-{os.getpid()}-{rank}-events"
        try:
            self.steps.bind(self.addresses[0])
            self.events.bind(self.addresses[1])
        except zmq.ZMQError:
            self.close()
            raise

    def send(self, data: bytes) -> None:
        with self.lock:
            self.steps.send(data, copy=False)

    def close(self) -> None:
        with self.lock:
            self.steps.close(linger=0)
        self.events.close(linger=0)


class _Worker:
    """One rank's owner for its Supervisor (pier.ipc.supervisor.ChildOwner)."""

    def __init__(self, executor: TensorParallelExecutor, rank: int, init: WorkerInit) -> None:
        self.executor, self.rank, self.init = executor, rank, init
        self.link: _Link | None = None
        self.said = ""  # the error it said before it exited
        self.supervisor = Supervisor(self, _NO_RESTART, f"llm-tp-rank{rank}", STOP_TIMEOUT_S, START_TIMEOUT_S)

    def launch(self) -> tuple[Launch, _Link]:
        link = _Link(self.executor.zmq, self.executor.folder, self.rank)
        return Launch([sys.executable, "-m", "pier.backends.llm.parallel.worker", *link.addresses],
                      new_session=True), link

    def _events(self, link: _Link) -> list[Any]:
        events: list[Any] = []
        while True:
            try:
                frame = link.events.recv(zmq.NOBLOCK)
            except zmq.Again:
                return events
            try:
                events.append(FROM_WORKER.decode(frame))
            except BadMessage as exc:
                log.error("%s", exc)

    def started(self, child: Child[_Link]) -> Readers:
        link = child.link

        def send_init() -> bool:
            if not link.steps.getsockopt(zmq.EVENTS) & zmq.POLLOUT:  # not connected yet
                return True
            link.send(encode(self.init))
            return False

        def answer() -> bool:
            for event in self._events(link):
                if isinstance(event, WorkerReady):
                    self.num_blocks = event.num_blocks
                    child.ready()
                elif isinstance(event, WorkerFailed):
                    message = f"tensor-parallel rank {self.rank}: {event.message}"
                    child.refuse(ValueError(message) if event.kind in ("ValueError", "KeyError")
                                 else RuntimeError(f"{event.kind}: {message}"))
            return True

        return {link.steps.getsockopt(zmq.FD): send_init, link.events.getsockopt(zmq.FD): answer}

    def serving(self, child: Child[_Link]) -> Readers:
        self.link = child.link

        def read() -> bool:
            for event in self._events(child.link):
                if isinstance(event, WorkerFailed):
                    self.said = f"{event.kind}: {event.message}"
            return True

        return {child.link.events.getsockopt(zmq.FD): read}

    def restarted(self, child: Child[_Link]) -> None:  # pragma: no cover - _NO_RESTART
        pass

    def lost(self, child: Child[_Link] | None, end: Exit) -> None:
        pid = f" (pid {child.pid})" if child is not None else ""
        said = f" after {self.said}" if self.said else ""
        self.executor.lost(f"tensor-parallel rank {self.rank} of {self.init.size}{pid} {end.cause}{said}")

    def ask_to_stop(self, child: Child[_Link]) -> None:
        try:
            child.link.send(encode(Shutdown()))
        except zmq.ZMQError:
            pass

    def stopped(self, child: Child[_Link] | None, killed: bool) -> None:
        self.link = None


def _settings(cfg: EngineConfig) -> dict[str, Any]:
    """The flat settings a worker builds its shard from (the model, cache and parallel groups)."""
    out = {f.name: getattr(group, f.name) for group in (cfg.model, cfg.cache, cfg.parallel) for f in fields(group)}
    out["model_path"] = None  # the worker is given the folder itself
    out["enable_lora"], out["max_lora_rank"] = cfg.lora.enable_lora, cfg.lora.max_lora_rank  # adapters: StepDelta.lora
    out["preemption_mode"] = cfg.scheduler.preemption_mode
    spec = cfg.scheduler.speculative_config  # a draft model's KV blocks: each rank budgets them alike
    out["speculative_config"] = None if spec is None else asdict(spec)
    return out


class TensorParallelExecutor:
    """Rank 0's side of the group (see the module's docstring). Made before rank 0 loads its shard
    (the workers load theirs meanwhile), `connect`ed after."""

    def __init__(self, folder: Path, cfg: EngineConfig, group: ParallelGroup, eos_ids: tuple[int, ...],
                 threads: int | None, max_model_len: int, socket_folder: str | None,
                 progress: Callable[[LoadProgress], None] | None = None) -> None:
        self.group = group
        par = cfg.parallel
        self.progress, self.join_timeout_s = progress, par.join_timeout_s
        self.local = par.local_ranks  # ranks 0..local-1 here, the others on other machines
        self.failure: str | None = None
        self.wake_r, self._wake_w = os.pipe()  # readable once a rank is lost (the engine core polls it)
        self.zmq = zmq.Context()
        self._own_folder = socket_folder is None
        self.folder = socket_folder or scratch_folder("pier-llm-tp-")
        self.runner: ModelRunner | None = None
        self.shipper = Shipper()
        self.lora_ops: Callable[[], list[LoRAOp]] = list  # the engine's LoRAManager.take_ops, with LoRA
        one_machine = self.local == group.size
        host, port = ("127.0.0.1", 0) if one_machine else (par.master_addr, par.master_port)
        self.store = dist.TCPStore(host, port, group.size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=TIMEOUT_S))
        self._closed = False
        self._errors: list[BaseException] = []
        self.shm: ShmAllReduce | None = None
        if group.device.type == "cpu" and one_machine:  # across machines: gloo's all-reduce alone
            remove_stale()
            self.shm = ShmAllReduce(segment_name(), 0, group.size, lambda: self.failure is not None, create=True)
        shm = "" if self.shm is None else self.shm.name
        self.workers = [_Worker(self, r, WorkerInit(r, group.size, "127.0.0.1", self.store.port, str(folder),
                                                    _settings(cfg), list(eos_ids), max_model_len, threads, shm))
                        for r in range(1, self.local)]
        self.remote: RemoteRanks | None = None
        if not one_machine:  # a remote rank joins through env:// (port 0), with its own threads' default
            self.remote = RemoteRanks(
                self.zmq, range(self.local, group.size), group.size, par.master_addr, par.master_port,
                lambda r: WorkerInit(r, group.size, "", 0, str(folder), _settings(cfg), list(eos_ids),
                                     max_model_len, par.num_threads, ""), self.lost)
        self._starts = [threading.Thread(target=self._start, args=(w,), name=f"llm-tp-start{w.rank}", daemon=True)
                        for w in self.workers]
        for t in self._starts:
            t.start()

    def _start(self, worker: _Worker) -> None:
        try:
            worker.supervisor.start()
        except BaseException as exc:  # noqa: BLE001 - connect() raises it
            self._errors.append(exc)

    def connect(self, runner: ModelRunner) -> None:
        """Once rank 0's shard is loaded: wait for the workers' (raises the first that failed), then join.
        A long wait is said on the log every WAIT_SAID_S, naming the rank (a start that never ends
        shows where it stopped)."""
        since = time.monotonic()
        for worker, t in zip(self.workers, self._starts, strict=True):
            t.join(WAIT_SAID_S)
            while t.is_alive():
                log.warning("still waiting for tensor-parallel rank %d of %d to load its shard (%.0f s so far)",
                            worker.rank, self.group.size, time.monotonic() - since)
                t.join(WAIT_SAID_S)
        if self._errors:
            raise self._errors[0]
        blocks = {w.rank: w.num_blocks for w in self.workers}
        if self.remote is not None:
            blocks.update(self.remote.wait(self.join_timeout_s, self.progress))
        for rank, num_blocks in sorted(blocks.items()):
            if num_blocks != runner.num_blocks:
                raise RuntimeError(f"tensor-parallel rank {rank} has {num_blocks} KV blocks, rank 0 "
                                   f"{runner.num_blocks}")
        self.group.join(self.store, loopback=self.remote is None)
        dist.barrier()  # every rank has mapped the shared-memory segment
        if self.shm is not None:
            self.shm.unlink()
            self.group.shm, self.shm = self.shm, None
        self.runner = runner

    def lost(self, reason: str) -> None:
        """A rank is gone (a supervisor's thread): the group cannot step any more."""
        if self.failure is None and not self._closed:
            self.failure = reason
            log.error("%s: the engine's group stops", reason)
            os.write(self._wake_w, b"x")

    def execute(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Ship the step to the workers (prepared: a draft model's drafts filled in, on rank 0 alone),
        run rank 0's shard of it; RankFailed once a rank is lost."""
        assert self.runner is not None
        if self.failure is not None:
            raise RankFailed(self.failure)
        self.runner.prepare(so)
        data = encode(self.shipper.delta(so, self.lora_ops()))
        for w in self.workers:
            if w.link is not None:
                w.link.send(data)
        if self.remote is not None:
            self.remote.send(data)
        try:
            return self.runner.run(so, grammar)
        except Exception as exc:
            if self._wait_failure():
                raise RankFailed(self.failure) from exc
            raise

    def _wait_failure(self, timeout_s: float = 10.0) -> bool:
        """Whether a rank is lost: a collective that failed is usually a rank that died, which its
        supervisor sees within moments."""
        import select

        if self.failure is None:
            select.select([self.wake_r], [], [], timeout_s)
        return self.failure is not None

    def close(self) -> None:
        """Stop the workers (a Shutdown, then a kill after STOP_TIMEOUT_S), leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in self._starts:
            t.join()
        for w in self.workers:
            w.supervisor.stop()
        if self.remote is not None:
            self.remote.close()
        if self.shm is not None:  # never handed to the group: the load failed
            self.shm.unlink()
            self.shm.close()
        self.group.leave()
        self.zmq.destroy(linger=0)  # every socket closed (term() would wait for one left open, forever)
        if self._own_folder:
            drop_scratch(self.folder)
        for fd in (self.wake_r, self._wake_w):
            os.close(fd)
