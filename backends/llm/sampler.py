"""Logits → next tokens, per row with that row's SamplingParams; run by the model runner.

Order (as vLLM): logprobs are taken from the raw logits; then penalties (repetition over prompt
and output, HF style; presence/frequency over output only), logit_bias, min_tokens masking, the
structured-output grammar's bitmask (computed engine-side, structured.py), then greedy
argmax, or temperature → top-k → top-p → min-p → a draw. A row with a seed draws from its own
generator, so its samples do not depend on what else is in the batch.

What a sequence's sampling depends on besides its params (its generator, the tokens it has seen,
how many it produced) is a `SamplingState` the runner keeps per sequence (vLLM's
CachedRequestState): made when the scheduler first hands the sequence over, advanced by each
token sampled here, dropped when the sequence ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams
from .structured import apply_bitmask


@dataclass(eq=False)
class SamplingState:
    """One sequence's sampling inputs beyond its params."""

    params: SamplingParams
    generator: torch.Generator | None
    seen: set[int] | None  # prompt and output ids (repetition_penalty only)
    output_counts: dict[int, int] = field(default_factory=dict)  # for presence/frequency penalties
    num_output: int = 0
    structured: bool = False  # a grammar masks its rows (the step's bitmask has a row for it)
    num_prompt: int = 0
    prompt_ids: list[int] | None = None  # kept when prompt_logprobs are asked for

    @classmethod
    def new(cls, params: SamplingParams, index: int, prompt_ids: list[int], device: torch.device) -> SamplingState:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed + index)
        return cls(params, generator, set(prompt_ids) if params.repetition_penalty != 1.0 else None,
                   structured=params.structured_outputs is not None, num_prompt=len(prompt_ids),
                   prompt_ids=prompt_ids if params.prompt_logprobs is not None else None)

    def fork(self, index: int, device: torch.device) -> SamplingState:
        """A child's state (n > 1): the same prompt, its own generator (seed + index)."""
        child = SamplingState.new(self.params, index, [], device)
        child.seen = None if self.seen is None else set(self.seen)
        child.num_prompt, child.prompt_ids = self.num_prompt, self.prompt_ids
        return child

    def append(self, token: int) -> None:
        self.num_output += 1
        if self.seen is not None:
            self.seen.add(token)
        p = self.params
        if p.presence_penalty or p.frequency_penalty:
            self.output_counts[token] = self.output_counts.get(token, 0) + 1


@dataclass
class SampleResult:
    """The chosen token, its logprob (raw model distribution), and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def sample(logits: torch.Tensor, seqs: list[SamplingState], eos_ids: tuple[int, ...],
           grammar: tuple[list[int], torch.Tensor] | None = None) -> list[SampleResult]:
    """One token for each row of `logits` ([M, V] float32), row i belonging to seqs[i]; each state
    is advanced by its token. `grammar`: (for each constrained row, its row of the bitmask; the bitmask)."""
    logprobs = None
    want_lp = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if want_lp:
        logprobs = torch.log_softmax(logits, dim=-1)
    raw = logits
    processed = _apply_penalties(logits, seqs, eos_ids)
    if processed is not logits:
        # One request's extreme penalties or masks must not fail the step (and with it every request
        # in flight): a row left with no finite logit samples from its raw logits instead.
        poisoned = (torch.isnan(processed) | (processed == float("inf"))).any(dim=-1)
        bad = poisoned | ~torch.isfinite(processed).any(dim=-1)
        if bool(bad.any()):
            processed[bad] = logits[bad]
    logits = processed
    constrained = [i for i, s in enumerate(seqs) if s.structured]
    if constrained:  # structured output: only what each grammar allows now
        assert grammar is not None and len(grammar[0]) == len(constrained)
        if logits is raw:
            logits = logits.clone()
        bitmask_rows, bitmask = grammar
        apply_bitmask(logits, constrained, bitmask[torch.tensor(bitmask_rows)], eos_ids[0] if eos_ids else None)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    chosen = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    if len(greedy) == len(seqs):
        chosen = logits.argmax(dim=-1)
    else:
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            chosen[g] = logits[g].argmax(dim=-1)
        random_rows = [i for i in range(len(seqs)) if not seqs[i].params.greedy]
        _sample_rows(logits, seqs, random_rows, chosen)
    ids = chosen.tolist()
    for state, t in zip(seqs, ids):
        state.append(t)
    results = [SampleResult(t) for t in ids]
    if logprobs is not None:
        for i in want_lp:
            row = logprobs[i]
            results[i].logprob = float(row[ids[i]])
            k = seqs[i].params.logprobs or 0
            if k:
                vals, idx = row.topk(k)
                results[i].top_logprobs = dict(zip(idx.tolist(), vals.tolist()))
    return results


def _apply_penalties(logits: torch.Tensor, seqs: list[SamplingState], eos_ids: tuple[int, ...]) -> torch.Tensor:
    cloned = False
    for i, s in enumerate(seqs):
        p = s.params
        needs_min = p.min_tokens and s.num_output < p.min_tokens
        if (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty and not needs_min
                and not p.logit_bias):
            continue
        if not cloned:
            logits = logits.clone()
            cloned = True
        row = logits[i]
        if p.repetition_penalty != 1.0:
            assert s.seen is not None
            idx = torch.tensor(sorted(s.seen), device=logits.device)
            vals = row[idx]
            row[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and s.output_counts:
            idx = torch.tensor(list(s.output_counts), device=logits.device)
            counts = torch.tensor(list(s.output_counts.values()), dtype=logits.dtype, device=logits.device)
            row[idx] -= p.frequency_penalty * counts + p.presence_penalty
        if p.logit_bias:
            idx = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            row.index_add_(0, idx, torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device))
        if needs_min:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            if banned:
                row[torch.tensor(sorted(banned), device=logits.device)] = float("-inf")
    return logits


def _sample_rows(logits: torch.Tensor, seqs: list[SamplingState], rows: list[int], chosen: torch.Tensor) -> None:
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    x = logits[idx]
    temps = torch.tensor([seqs[i].params.temperature for i in rows], dtype=x.dtype, device=dev)
    x = x / temps.unsqueeze(1)
    top_k = [seqs[i].params.top_k for i in rows]
    if any(k > 0 for k in top_k):
        vocab = x.shape[-1]
        ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=dev)
        sorted_x = x.sort(dim=-1, descending=True).values
        kth = sorted_x.gather(1, (ks - 1).unsqueeze(1))
        x = x.masked_fill(x < kth, float("-inf"))
    top_p = [seqs[i].params.top_p for i in rows]
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(top_p, dtype=x.dtype, device=dev).unsqueeze(1)
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= ps
        drop_sorted[:, 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(dim=-1)
    min_p = [seqs[i].params.min_p for i in rows]
    if any(m > 0 for m in min_p):
        ms = torch.tensor(min_p, dtype=x.dtype, device=dev).unsqueeze(1)
        probs = probs.masked_fill(probs < ms * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    unseeded = [j for j, i in enumerate(rows) if seqs[i].generator is None]
    if unseeded:
        u = torch.tensor(unseeded, device=dev)
        picks = torch.multinomial(probs[u], 1).squeeze(1)
        chosen[idx[u]] = picks
    for j, i in enumerate(rows):
        gen = seqs[i].generator
        if gen is not None:
            chosen[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
