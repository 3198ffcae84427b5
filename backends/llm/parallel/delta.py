"""A step's SchedulerOutput as the delta rank 0 ships (`Shipper`) and as a worker rebuilds it
(`Receiver`): both keep every live sequence's block tables (one per KV cache group) as the workers
last saw them, so only their change travels."""

from __future__ import annotations

from ..lora import LoRAOp
from ..scheduler_output import NewSequence, ScheduledSeq, SchedulerOutput
from .messages import NewSeq, SeqStep, StepDelta


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class Shipper:
    """Rank 0's side: what the workers hold of each sequence's block table."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}  # every KV cache group's (kv_groups.py)

    def delta(self, so: SchedulerOutput, lora: list[LoRAOp] | None = None) -> StepDelta:
        tables = self.tables
        for sid in so.finished_seq_ids:
            tables.pop(sid, None)
        steps = []
        for s in so.scheduled:
            held = tables.get(s.seq_id)
            now = [s.block_table, *s.group_tables]
            keeps = [0] * len(now) if held is None else [_common(h, t) for h, t in zip(held, now)]
            tables[s.seq_id] = [list(t) for t in now]
            steps.append(SeqStep(s.seq_id, s.token_ids, s.start_pos, keeps[0], s.block_table[keeps[0]:], s.sample,
                                 s.prompt_logprobs, s.forks, s.draft_token_ids,
                                 [(k, t[k:]) for k, t in zip(keeps[1:], now[1:])], s.lora_id))
        return StepDelta([NewSeq(n.seq_id, n.index, n.prompt_ids, n.params) for n in so.new_seqs], steps,
                         so.finished_seq_ids, so.blocks_to_swap_out, so.blocks_to_copy, so.blocks_to_swap_in,
                         lora or [])


class Receiver:
    """A worker's side: the SchedulerOutput rank 0 had, rebuilt from its delta."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def output(self, d: StepDelta) -> SchedulerOutput:
        tables = self.tables
        for sid in d.finished:
            tables.pop(sid, None)
        scheduled = []
        for s in d.scheduled:
            held = tables.get(s.seq_id) or [[]] * (1 + len(s.groups))
            now = [h[:keep] + blocks for h, (keep, blocks) in zip(held, [(s.keep, s.blocks), *s.groups])]
            tables[s.seq_id] = now
            scheduled.append(ScheduledSeq(s.seq_id, s.token_ids, s.start_pos, now[0], s.sample, s.prompt_logprobs,
                                          s.forks, s.draft_token_ids, lora_id=s.lora_id, group_tables=now[1:]))
        return SchedulerOutput(scheduled, [NewSequence(n.seq_id, n.index, n.prompt_ids, n.params) for n in d.new],
                               d.finished, d.swap_out, d.copy, d.swap_in)
