"""What rank 0 (executor.py, in the engine-core process) and the other ranks (worker.py) say to each
other: typed messages (pier.ipc.messages), one ZeroMQ frame each.

    rank 0 -> worker   WorkerInit (once), then a StepDelta per step, and Shutdown
    worker -> rank 0   WorkerReady | WorkerFailed (to WorkerInit), WorkerFailed before it exits on an error

A rank on another machine (`pier tp-worker`, remote.py) says Hello first (which rank it is); rank 0
answers WorkerInit, or Unwelcome (a rank it does not wait for) and the worker exits saying why.

A step ships its delta (vLLM's SchedulerOutput with NewRequestData / CachedRequestData): a sequence a
worker has not seen comes whole (its prompt and sampling parameters, `NewSequence`), one it has as the
step's tokens and the change of its block table (`SeqStep.keep` entries of the table it had, then
`SeqStep.blocks`): a decode's table grows by a block every block_size steps, and is not sent again.
"""

from __future__ import annotations

from typing import Any

from pier.ipc.messages import Codec, Message

from ..sampling_params import SamplingParams


class WorkerInit(Message):
    """Build rank `rank` of `size` from `model_dir` and `settings` (EngineConfig's flat settings the
    worker uses), then join the group at host:port (port 0: torch's env:// settings)."""

    rank: int
    size: int
    host: str
    port: int
    model_dir: str
    settings: dict[str, Any]
    eos_ids: list[int]
    max_model_len: int
    threads: int | None  # torch threads of this rank (None: torch's default)
    shm: str  # the shared-memory all-reduce's segment (shm_allreduce.py; "" none: gloo alone)


class NewSeq(Message):
    seq_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams


class SeqStep(Message):
    seq_id: str
    token_ids: list[int]
    start_pos: int
    keep: int  # entries of the block table the worker holds for it that stay
    blocks: list[int]  # then these
    sample: bool
    prompt_logprobs: bool
    forks: list[tuple[str, int]]
    draft_token_ids: list[int]
    groups: list[tuple[int, list[int]]]  # (keep, blocks) of each KV cache group's table after the first
    lora_id: int  # the LoRA adapter it runs (0: the base model)


class StepDelta(Message):
    new: list[NewSeq]
    scheduled: list[SeqStep]
    finished: list[str]
    swap_out: list[tuple[int, int]]
    copy: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    # LoRA adapters rank 0 installed or evicted since the last step, in order (lora.py's LoRAOp):
    # (id, path) read and install it, (id, "") evict it; a worker does so before the step
    lora: list[tuple[int, str]]


class Shutdown(Message):
    pass


class WorkerReady(Message):
    rank: int
    num_blocks: int


class WorkerFailed(Message):
    rank: int
    kind: str  # the exception's type name: ValueError is the model's fault
    message: str


class Hello(Message):
    """A remote worker's first word: its rank, and where it runs (for the messages that name it)."""

    rank: int
    host: str
    pid: int


class Unwelcome(Message):
    message: str


ToWorker = WorkerInit | StepDelta | Shutdown | Unwelcome
FromWorker = WorkerReady | WorkerFailed | Hello

TO_WORKER: Codec[ToWorker] = Codec(ToWorker, "tensor-parallel rank 0 to worker")
FROM_WORKER: Codec[FromWorker] = Codec(FromWorker, "tensor-parallel worker to rank 0")
