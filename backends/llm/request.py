"""Per-sequence state as the engine keeps it: token ids, how many are in the KV cache, status, timestamps.

(`SequenceState`, not `Sequence`: that name is collections.abc's. What the sampler needs of a
sequence, its generator and penalty counts, the model runner keeps: sampler.SamplingState.)"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams


def seq_id(request_id: str, index: int) -> str:
    """Sequence `index` of a request (n > 1 has several): "<request id>#<index>"."""
    return f"{request_id}#{index}"


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class SequenceState:
    """One generated continuation. A request with n > 1 has n sequences (`index` 0..n-1); sequence 0
    computes the prompt, then the others fork from it (sharing the prompt's blocks) and sample their
    first token from its logits."""

    seq_id: str
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # tokens whose K/V are in the cache (or scheduled this step)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    pending_forks: int = 0  # children to fork once the prompt is computed (n > 1)
    detok: Any = None  # tokenizer.IncrementalDetokenizer
    matcher: Any = None  # llguidance.LLMatcher: structured output's grammar state (structured.py)
    num_preemptions: int = 0
    lora_id: int = 0  # the LoRA adapter's id (lora.LoRAManager; new at every load), 0: the base model
    # prompt_logprobs: (token id, logprob, alternatives) for prompt positions 1.. computed so far;
    # position 0 has none. Sent once, with the first output.
    prompt_lp: list[tuple[int, float, dict[int, float] | None]] = field(default_factory=list)
    prompt_lp_sent: bool = False
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def fork_ids(self) -> list[tuple[str, int]]:
        """(seq id, index) of the children still to fork from this sequence."""
        return [(seq_id(self.request_id, i), i) for i in range(self.index + 1, self.index + 1 + self.pending_forks)]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """prompt_logprobs asked for and not all computed yet (those positions must be computed,
        not taken from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_lp) < len(self.prompt_ids) - 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
