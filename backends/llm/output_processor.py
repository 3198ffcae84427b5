"""A step's results as each sequence's `RequestOutput` (vLLM's output processor).

The sequences a request runs as, their detokenizers and grammar matchers live here: sampled tokens
are appended, a grammar moves on, the stop conditions are checked (EOS, stop token ids, stop strings
on the detokenized text, max_tokens, the context length), the text delta is cut (held back while it
could still become a stop string), prompt logprobs are gathered position by position, an embedding
request's vector is its answer, and the children of an n > 1 request are forked from sequence 0 when
its prompt has been computed. A finished sequence leaves the scheduler (its blocks are freed) at once.
"""

from __future__ import annotations

import dataclasses
import time

from .kv_cache import KVCacheManager
from .outputs import ModelRunnerOutput, RequestMetrics, RequestOutput, SampleLogprobs
from .request import SequenceState, seq_id
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput
from .structured import GrammarCompiler
from .tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    """Owns `requests`: request id -> its sequences (index 0 .. n - 1), until all have finished."""

    def __init__(self, tokenizer: Tokenizer, grammars: GrammarCompiler, scheduler: Scheduler, kv: KVCacheManager,
                 eos_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer, self.grammars = tokenizer, grammars
        self.scheduler, self.kv = scheduler, kv
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.requests: dict[str, list[SequenceState]] = {}
        self.generation_tokens = 0

    def new_seq(self, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                arrival: float) -> SequenceState:
        seq = SequenceState(seq_id(request_id, index), request_id, index, prompt, params, arrival_time=arrival)
        seq.detok = IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
        if params.structured_outputs is not None:  # each sequence (n > 1 too) walks its own grammar
            seq.matcher = self.grammars.matcher(params.structured_outputs)
        return seq

    def seq(self, sid: str) -> SequenceState:
        rid, index = sid.rsplit("#", 1)
        return self.requests[rid][int(index)]

    def running(self, sid: str) -> SequenceState | None:
        """The sequence, unless it has finished (its request may be gone)."""
        rid, index = sid.rsplit("#", 1)
        seqs = self.requests.get(rid)
        seq = seqs[int(index)] if seqs is not None else None
        return None if seq is None or seq.finished else seq

    def abort(self, request_id: str) -> list[RequestOutput]:
        seqs = self.requests.pop(request_id, None) or []
        outs = []
        for seq in seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
                outs.append(self._output(seq, [], [], True))
        return outs

    def process(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply one step's results; the outputs of every sequence that got a token or ended."""
        for sid, chunk in out.prompt_logprobs.items():
            seq = self.seq(sid)
            for j, value in enumerate(chunk.logprobs):
                pos = chunk.first_position + j
                if pos == len(seq.prompt_lp) + 1:  # not kept yet (a recomputed chunk repeats positions)
                    seq.prompt_lp.append((seq.prompt_ids[pos], value, chunk.top[j] if chunk.top else None))
        for s in so.scheduled:
            if s.forks:
                self._fork(self.seq(s.seq_id), s.forks)
        outs = [self._pooled(self.seq(sid), vector) for sid, vector in out.pooled.items()]
        now = time.monotonic()
        last: RequestOutput | None = None
        for sid, tok, lp in zip(out.seq_ids, out.sampled_token_ids, out.logprobs):
            live = self.running(sid)
            if live is None:  # speculative tokens after the one that ended the sequence
                continue
            o = self._append_token(live, tok, lp, now)
            if last is not None and (last.request_id, last.index) == (o.request_id, o.index):
                outs[-1] = last = _merged(last, o)  # several tokens of one sequence in one step: one output
            else:
                outs.append(o)
                last = o
        return outs

    def _fork(self, parent: SequenceState, forks: list[tuple[str, int]]) -> None:
        """n > 1: the children share every prompt block (copy-on-write later) and sample their first
        token from the parent's logits in the same step."""
        rid = parent.request_id
        for _, index in forks:
            child = self.new_seq(rid, index, parent.prompt_ids, parent.params, parent.arrival_time)
            child.first_scheduled_time = parent.first_scheduled_time
            child.lora_id = parent.lora_id
            self.kv.fork(parent.seq_id, child.seq_id)
            child.prompt_lp, child.prompt_lp_sent = parent.prompt_lp, True  # sent once, by the parent
            child.num_computed = parent.num_computed
            self.requests[rid].append(child)
            self.scheduler.add_running(child)
        parent.pending_forks = 0

    def _pooled(self, seq: SequenceState, vector: list[float]) -> RequestOutput:
        self.scheduler.finish(seq, "stop")
        self.requests.pop(seq.request_id, None)
        return dataclasses.replace(self._output(seq, [], None, True), embedding=vector)

    def _append_token(self, seq: SequenceState, tok: int, lp: SampleLogprobs | None, now: float) -> RequestOutput:
        if seq.matcher is not None and not seq.matcher.is_stopped():
            seq.matcher.consume_token(tok)  # the mask allowed it: the grammar moves on
        seq.token_ids.append(tok)
        self.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        p = seq.params
        reason = None
        past_min = seq.num_output >= p.min_tokens
        eos = not p.ignore_eos and tok in self.eos_ids
        if past_min and (eos or tok in p.stop_token_ids):
            if p.include_stop_str_in_output:  # as vLLM: a stop token's text is left out by default
                seq.detok.add(tok)
            reason, seq.stop_reason = "stop", None if eos else tok  # as vLLM: EOS has no stop_reason
        elif (stop_str := seq.detok.add(tok, check_stop=past_min)) is not None:
            reason, seq.stop_reason = "stop", stop_str
        elif (p.max_tokens is not None and seq.num_output >= p.max_tokens) or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if all(s.finished for s in self.requests.get(seq.request_id, [])):
                self.requests.pop(seq.request_id, None)
        return self._output(seq, [tok], None if lp is None else [lp], reason is not None)

    def _output(self, seq: SequenceState, new_ids: list[int], logprobs: list[SampleLogprobs] | None,
                finished: bool) -> RequestOutput:
        if finished and seq.finish_reason != "abort":
            seq.detok.flush()
        text = seq.detok.take(finished)
        prompt_lp = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_lp_sent and not seq.wants_prompt_logprobs:
            prompt_lp = [(seq.prompt_ids[0], None, None), *seq.prompt_lp]
            seq.prompt_lp_sent = True
        m = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                           seq.last_token_time, seq.finished_time)
        return RequestOutput(
            request_id=seq.request_id, index=seq.index, text=text, token_ids=new_ids, finished=finished,
            finish_reason=seq.finish_reason if finished else None, prompt_tokens=seq.num_prompt,
            completion_tokens=seq.num_output, cumulative_text=seq.detok.text[: seq.detok.emitted],
            logprobs=logprobs, stop_reason=seq.stop_reason if finished else None, metrics=m,
            prompt_logprobs=prompt_lp,  # type: ignore[arg-type]
            prompt_ids=seq.prompt_ids if logprobs is not None and seq.num_output == len(new_ids) else None,
        )


def _merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one sequence as one (deltas joined; the later one's state)."""
    return dataclasses.replace(
        b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
        logprobs=None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs,
        prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs, prompt_ids=a.prompt_ids or b.prompt_ids)
