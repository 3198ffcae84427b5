"""A step's SchedulerOutput as the delta rank 0 ships (`Shipper`) and as a worker rebuilds it
(`Receiver`): both keep every live sequence's block table as the workers last saw it, so only its
change travels."""

from __future__ import annotations

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
        self.tables: dict[str, list[int]] = {}

    def delta(self, so: SchedulerOutput) -> StepDelta:
        tables = self.tables
        for sid in so.finished_seq_ids:
            tables.pop(sid, None)
        steps = []
        for s in so.scheduled:
            held = tables.get(s.seq_id)
            keep = 0 if held is None else _common(held, s.block_table)
            tables[s.seq_id] = list(s.block_table)
            steps.append(SeqStep(s.seq_id, s.token_ids, s.start_pos, keep, s.block_table[keep:], s.sample,
                                 s.prompt_logprobs, s.forks, s.draft_token_ids))
        return StepDelta([NewSeq(n.seq_id, n.index, n.prompt_ids, n.params) for n in so.new_seqs], steps,
                         so.finished_seq_ids, so.blocks_to_swap_out, so.blocks_to_copy, so.blocks_to_swap_in)


class Receiver:
    """A worker's side: the SchedulerOutput rank 0 had, rebuilt from its delta."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def output(self, d: StepDelta) -> SchedulerOutput:
        tables = self.tables
        for sid in d.finished:
            tables.pop(sid, None)
        scheduled = []
        for s in d.scheduled:
            table = tables.get(s.seq_id, [])[: s.keep] + s.blocks
            tables[s.seq_id] = table
            scheduled.append(ScheduledSeq(s.seq_id, s.token_ids, s.start_pos, table, s.sample, s.prompt_logprobs,
                                          s.forks, s.draft_token_ids))
        return SchedulerOutput(scheduled, [NewSequence(n.seq_id, n.index, n.prompt_ids, n.params) for n in d.new],
                               d.finished, d.swap_out, d.copy, d.swap_in)
