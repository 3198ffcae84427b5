"""What runs in one step: the scheduler's decision, as plain data the model runner consumes.

The scheduler never touches tensors; the model runner never touches queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class NewSequence:
    """A sequence the model runner has not seen: what its sampler needs (vLLM's NewRequestData)."""

    seq_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ScheduledSeq:
    """One sequence's share of the step: compute `token_ids` at positions start_pos.. ."""

    seq_id: str
    token_ids: list[int]
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    prompt_logprobs: bool = False  # return the log-softmax of every row of this chunk
    # n > 1: (seq id, index) of the children that sample their first token from this row too, after
    # this sequence (they share its prompt; the runner starts their sampler state from its own)
    forks: list[tuple[str, int]] = field(default_factory=list)
    # speculative decoding: the last `len(draft_token_ids)` of token_ids are drafts (spec_decode.py),
    # verified in this pass; the sampling starts at the row of the last known token
    draft_token_ids: list[int] = field(default_factory=list)
    lora_id: int = 0  # the LoRA adapter this sequence runs (lora.py), 0 for the base model
    # the block tables of the KV cache groups after the first (kv_groups.py; none for a model whose
    # layers are one attention kind): `block_table` is the first group's
    group_tables: list[list[int]] = field(default_factory=list)


@dataclass
class GrammarBitmask:
    """Structured output's allowed tokens for this step, computed engine-side from each sequence's
    grammar state (structured.py): bit t of row i set = token t allowed for `seq_ids[i]` (vLLM's
    grammar bitmask). A forking row's children start in the same grammar state: they use its row."""

    seq_ids: list[str]
    bitmask: torch.Tensor  # [len(seq_ids), ceil(vocab / 32)] int32


@dataclass
class SchedulerOutput:
    """The step's batch plus the block moves the runner performs before the forward, in order:
    swap out, copy (copy-on-write after a fork), swap in; and, for the runner's per-sequence state,
    the sequences it meets for the first time and those that ended since the last step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    new_seqs: list[NewSequence] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.finished_seq_ids)
