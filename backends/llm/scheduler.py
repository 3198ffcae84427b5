"""Continuous batching over a token budget, with chunked prefill and preemption.

Each step, in this order:
1. running sequences (oldest first) get their next tokens — one for a decode, the rest of the
   prompt (up to the budget) for a chunked prefill. When the pool is short, the most recently
   admitted running sequence is preempted (recompute: blocks freed, re-queued first; swap: blocks
   copied to the CPU area), possibly the sequence being scheduled itself; with scheduling_policy
   "priority" the waiting queue is kept in (priority, arrival) order and the victim is the lowest
   priority, latest arrival;
2. without a preemption this step, swapped sequences come back first (FIFO);
3. then waiting sequences are admitted while `max_num_seqs`, the token budget and the pool allow;
   a prompt longer than the remaining budget is split (chunked prefill), so decodes never stall
   behind a long prompt. Prefix-cache hits skip the cached blocks. With LoRA, at most `max_loras`
   distinct adapters run at once: a request for another adapter waits (those behind it may go).
The result is a SchedulerOutput; nothing here touches tensors.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from .config import EngineConfig
from .kv_cache import NO_HIT, KVCacheManager
from .request import SeqStatus, SequenceState
from .scheduler_output import NewSequence, ScheduledSeq, SchedulerOutput


class Scheduler:
    """Owns the waiting / running / swapped queues and the KV block accounting."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 propose: Callable[[SequenceState], list[int]] | None = None) -> None:
        """`propose`: speculative decoding's draft hook (spec_decode.Proposer.propose): draft
        tokens for a sequence about to decode, scheduled with its last token when they fit."""
        self.config = config.scheduler
        self.kv = kv
        self.propose = propose
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.swapped: deque[SequenceState] = deque()
        self.num_preemptions = 0
        self._finished: list[str] = []  # ended since the last step: the runner drops their state
        self.by_priority = self.config.scheduling_policy == "priority"
        self.max_loras = config.lora.max_loras if config.lora.enable_lora else 0

    @staticmethod
    def _rank(seq: SequenceState) -> tuple[int, float]:
        return seq.params.priority, seq.arrival_time

    def _wait(self, seq: SequenceState, front: bool = False) -> None:
        """Queue `seq` to wait: at the back (a preempted one at the front), or, by priority, in
        (priority, arrival) order."""
        seq.status = SeqStatus.WAITING
        if self.by_priority:
            keys = [self._rank(s) for s in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, self._rank(seq)), seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def add(self, seq: SequenceState) -> None:
        self._wait(seq)

    def add_running(self, seq: SequenceState) -> None:
        """A forked child joins the running queue directly (its blocks are shared already)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: SequenceState, reason: str) -> None:
        """Remove a sequence from whatever queue holds it and free its blocks at once."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
        self.kv.free(seq.seq_id)
        self._finished.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished)
        self._finished = []
        if self.by_priority:
            self._preempt_for_priority(out)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # A prefill chunk leaves one token of budget for every decode behind it, so a long prompt
        # admitted earlier never stalls sequences that are already generating.
        decodes_left = sum(1 for s in self.running if len(s.token_ids) - s.num_computed == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = len(seq.token_ids) - seq.num_computed
            drafts: list[int] = []
            if remaining == 1:
                decodes_left -= 1
                if self.propose is not None:  # the drafts take what the budget leaves past one per decode
                    drafts = self.propose(seq)[: max(budget - decodes_left - 1, 0)]
                num_new = 1 + len(drafts)
            else:
                num_new = min(remaining, budget - decodes_left)
                if num_new <= 0:
                    i += 1
                    continue
            copies = None
            while copies is None:
                copies = self.kv.allocate(seq.seq_id, seq.token_ids, seq.num_computed, num_new)
                if copies is None and drafts:  # short of blocks: decode without drafts before preempting
                    drafts, num_new = [], 1
                    continue
                if copies is None:
                    # the most recently admitted (not yet scheduled this step), or by priority the
                    # lowest priority, latest arrival among those
                    victim = max(self.running[i:], key=self._rank) if self.by_priority else self.running[-1]
                    self.running.remove(victim)
                    if victim is not seq and len(victim.token_ids) - victim.num_computed == 1:
                        decodes_left -= 1
                    self._preempt(victim, out)
                    if victim is seq:
                        break
            if copies is None:
                break
            out.blocks_to_copy.extend(copies)
            self._emit(seq, num_new, out, drafts)
            budget -= num_new
            i += 1
        return budget

    def rollback(self, seq: SequenceState) -> None:
        """After a step that verified drafts of `seq`: its KV is valid up to its last token (the one
        sampled this step is computed next step); the blocks past that go back to the pool."""
        if seq.status is SeqStatus.RUNNING and seq.num_computed >= len(seq.token_ids):
            seq.num_computed = len(seq.token_ids) - 1
            self.kv.truncate(seq.seq_id, seq.num_computed)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Before the step: while the best waiting request cannot get a seat or its prompt's blocks,
        preempt the running one of lower priority (lowest, latest arrival first) (vLLM's priority
        preemption)."""
        while self.waiting and self.running:
            top = self.waiting[0]
            victim = max(self.running, key=self._rank)
            if self._rank(victim) <= self._rank(top):
                return
            need = self.kv.blocks_for(len(top.token_ids))
            if self._seats() + 1 + top.pending_forks <= self.config.max_num_seqs and self.kv.pool.num_free >= need:
                return
            self.running.remove(victim)
            self._preempt(victim, out, swap=False)  # swapped ones come back before waiting ones: recompute

    def _seats(self) -> int:
        """Sequences running, counting the children a request forks once its prompt is in (n > 1),
        so that max_num_seqs bounds what runs together after the forks too."""
        return sum(1 + s.pending_forks for s in self.running)

    def running_loras(self) -> set[int]:
        """The LoRA adapter ids the running sequences use (not the base model's 0)."""
        return {s.lora_id for s in self.running if s.lora_id} if self.max_loras else set()

    def _lora_full(self, seq: SequenceState, loras: set[int]) -> bool:
        """Whether `seq` must wait because max_loras other adapters run already."""
        return bool(seq.lora_id) and seq.lora_id not in loras and len(loras) >= self.max_loras

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        seats = self._seats()
        loras = self.running_loras()
        while self.swapped and budget > 0:
            seq = self.swapped[0]
            if seats + 1 + seq.pending_forks > self.config.max_num_seqs or self._lora_full(seq, loras):
                break
            num_new = min(len(seq.token_ids) - seq.num_computed, budget)
            if not self.kv.can_swap_in(seq.seq_id, seq.num_computed, num_new):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(seq.seq_id))
            copies = self.kv.allocate(seq.seq_id, seq.token_ids, seq.num_computed, num_new)
            assert copies is not None  # room was checked above
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seats += 1 + seq.pending_forks
            if seq.lora_id:
                loras.add(seq.lora_id)
            self._emit(seq, num_new, out)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        seats = self._seats()
        loras = self.running_loras()
        i = 0  # requests for an adapter past max_loras are passed over: they wait, the rest go
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if seats + 1 + seq.pending_forks > self.config.max_num_seqs:
                break
            if self._lora_full(seq, loras):
                i += 1
                continue
            hit = NO_HIT if seq.wants_prompt_logprobs else self.kv.computed_prefix(
                seq.seq_id, seq.token_ids, seq.lora_id)
            num_cached = hit.num_blocks * self.kv.block_size
            num_new = min(len(seq.token_ids) - num_cached, budget)
            copies = self.kv.allocate(seq.seq_id, seq.token_ids, num_cached, num_new, hit, seq.lora_id)
            if copies is None:
                break
            self.kv.record_prefix_lookup(len(seq.token_ids), num_cached)
            del self.waiting[i]
            if seq.lora_id:
                loras.add(seq.lora_id)
            seq.num_computed = num_cached
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:  # its first step: the runner meets it
                seq.first_scheduled_time = time.monotonic()
                out.new_seqs.append(NewSequence(seq.seq_id, seq.index, seq.prompt_ids, seq.params))
            self.running.append(seq)
            seats += 1 + seq.pending_forks
            self._emit(seq, num_new, out)
            budget -= num_new

    def _emit(self, seq: SequenceState, num_new: int, out: SchedulerOutput, drafts: list[int] | None = None) -> None:
        start = seq.num_computed
        drafts = drafts or []
        sample = start + num_new - len(drafts) == len(seq.token_ids)
        out.scheduled.append(
            ScheduledSeq(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids[start : start + num_new] + drafts,
                start_pos=start,
                block_table=list(self.kv.block_table(seq.seq_id)),
                group_tables=[list(t) for t in self.kv.group_tables(seq.seq_id)],
                sample=sample,
                prompt_logprobs=seq.wants_prompt_logprobs and start < seq.num_prompt,
                forks=seq.fork_ids if sample else [],
                draft_token_ids=drafts,
                lora_id=seq.lora_id,
            )
        )
        seq.num_computed = start + num_new

    def _preempt(self, seq: SequenceState, out: SchedulerOutput, swap: bool = True) -> None:
        self.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq.seq_id)
        if swap and self.config.preemption_mode == "swap":
            pairs = self.kv.swap_out(seq.seq_id)
            if pairs is not None:
                out.blocks_to_swap_out.extend(pairs)
                seq.status = SeqStatus.SWAPPED
                self.swapped.append(seq)
                return
        self.kv.free(seq.seq_id)
        seq.num_computed = 0
        self._wait(seq, front=True)

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "swapped": len(self.swapped),
            "preemptions": self.num_preemptions,
        }
