"""What runs in one step: the scheduler's decision, as plain data the model runner consumes.

The scheduler never touches tensors; the model runner never touches queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledSeq:
    """One sequence's share of the step: compute `token_ids` at positions start_pos.. ."""

    seq_id: str
    token_ids: list[int]
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    prompt_logprobs: bool = False  # return the log-softmax of every row of this chunk


@dataclass
class SchedulerOutput:
    """The step's batch plus the block moves the runner performs before the forward, in order:
    swap out, copy (copy-on-write after a fork), swap in."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in)
