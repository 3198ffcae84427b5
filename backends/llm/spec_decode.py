"""Speculative decoding (vLLM's `speculative_config`): n-gram prompt lookup or a draft model.

Three parts, each where its data lives:
- `SpeculativeConfig`: the model's `speculative_config` parameter (vLLM's JSON), checked once;
  every refusal names the field.
- `Proposer` (the scheduler's hook): how many drafts a sequence about to decode gets and, for the
  n-gram method, which: the continuation of the longest n-gram (n in [prompt_lookup_min,
  prompt_lookup_max]) that ends the sequence and occurred earlier, at its earliest occurrence
  (vLLM's proposer), up to `num_speculative_tokens` tokens. With a draft model the scheduler
  reserves the K positions and the model runner's draft model (spec_draft.py) fills them in before
  the target's forward. The scheduler schedules the sequence's last token and the drafts together
  (K + 1 positions, one forward pass), and after the step rolls back what was rejected
  (`Scheduler.rollback`: KV blocks past the accepted tokens go back to the pool; prefix-cache hashes
  only ever cover accepted tokens).
- `verify` (the model runner's): the draft positions' logits are sampled one position after the
  other with the ordinary sampler and each sequence's own sampling state, and a draft token is
  accepted while it equals the token sampled there; the first sampled token that differs (or the
  bonus token after the last draft) ends the sequence's step. For n-gram drafts the draft
  distribution q is one-hot, and for a one-hot q vLLM's rejection sampler (accept x when
  p(x)/q(x) >= u, else draw from max(p - q, 0)) is exactly this: accept with probability p(x), else
  draw from p without x. A draft model drafts greedily (vLLM's default `draft_sample_method`
  "greedy": its distribution is taken as one-hot), so the same holds for it. So greedy output
  equals decoding without speculation, and sampled output has the same distribution, with every
  setting (penalties, logit bias, min-p, top-k, seeds) applied by the same code as without
  speculation; a seeded request even draws the same numbers.
Requests with structured output get no drafts (their grammar's mask is computed for one position
a step) and decode one token a step in the same batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from .request import SequenceState
    from .sampler import SampleResult, SamplingState

MAX_SPEC_LEN = 32  # as vLLM's rejection sampler
_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked `speculative_config`: `num_speculative_tokens` drafts a step, by n-gram prompt
    lookup or (method "draft_model") by the model in the folder `model` (a relative path is relative
    to the served model's folder; the engine resolves and checks it at load)."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    method: str = "ngram"
    model: str | None = None

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig | None:
        """Parse the parameter (empty: no speculation). Raises ValueError naming the bad field."""
        if not text.strip():
            return None
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise ValueError(f"speculative_config: unsupported field(s) {', '.join(unknown)} "
                             f"(this engine implements {', '.join(_FIELDS)})")
        method, model = raw.get("method"), raw.get("model")
        if model in ("ngram", "[ngram]") and method in (None, "ngram"):
            method, model = "ngram", None
        if method is None and model is not None:
            method = "draft_model"
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method {method!r} is not supported "
                             "(supported: 'ngram', 'draft_model')")
        k = _int(raw, "num_speculative_tokens", method, required=True)
        if not 1 <= k <= MAX_SPEC_LEN:
            raise ValueError(f"speculative_config: num_speculative_tokens must be between 1 and {MAX_SPEC_LEN}, "
                             f"got {k}")
        if method == "draft_model":
            if not isinstance(model, str) or not model.strip():
                raise ValueError("speculative_config: method 'draft_model' needs 'model', the folder of the draft "
                                 f"model, got {model!r}")
            given = [f for f in ("prompt_lookup_min", "prompt_lookup_max") if f in raw]
            if given:
                raise ValueError(f"speculative_config: {', '.join(given)} only apply to method 'ngram'")
            return cls(k, method="draft_model", model=model)
        if model is not None:
            raise ValueError(f"speculative_config: method 'ngram' takes no 'model', got {model!r}")
        lo, hi = _int(raw, "prompt_lookup_min", method), _int(raw, "prompt_lookup_max", method)
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's default for both
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        assert lo is not None and hi is not None
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value < 1:
                raise ValueError(f"speculative_config: {name} must be at least 1, got {value}")
        if lo > hi:  # vLLM's words
            raise ValueError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls(k, lo, hi)


def _int(raw: dict[str, Any], name: str, method: str, required: bool = False) -> Any:
    value = raw.get(name)
    if value is None:
        if required:
            raise ValueError(f"speculative_config: {name} is required for method {method!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config: {name} must be an integer, got {value!r}")
    return value


def ngram_lookup(tokens: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix n-gram,
    n in [lo, hi] (vLLM's proposer: tokens [1,2,3,4,2,3], lo 2, hi 3, k 4 -> [4, 2, 3])."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0 .. length - 1 - n
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class Proposer:
    """The scheduler's draft hook: drafts for a sequence about to decode, or [] (no draft). With a
    draft model the drafts are placeholders (0) that the model runner's draft model fills in."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, seq: SequenceState) -> list[int]:
        p = seq.params
        if seq.matcher is not None or p.embed:
            return []
        room = self.max_model_len - len(seq.token_ids)  # the drafts' positions stay inside the context
        if p.max_tokens is not None:  # and no more than the request can still emit, the bonus token aside
            room = min(room, p.max_tokens - seq.num_output - 1)
        k = min(self.config.num_speculative_tokens, room)
        if k <= 0:
            return []
        c = self.config
        if c.method == "draft_model":
            return [0] * k
        return ngram_lookup(np.asarray(seq.token_ids, dtype=np.int64), c.prompt_lookup_min, c.prompt_lookup_max, k)


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters (per engine)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


def verify(first: list[SampleResult], drafts: list[list[int]], states: list[SamplingState],
           draft_logits: torch.Tensor,
           sample: Callable[[torch.Tensor, list[SamplingState]], list[SampleResult]],
           stats: SpecDecodeStats) -> list[list[SampleResult]]:
    """Accept drafts position by position. Entry i is a sequence whose token after its last known
    one was sampled already (`first[i]`), with its draft tokens and its sampling state;
    `draft_logits` holds, entry after entry, the logits of the rows after each draft token
    (len(drafts[i]) rows each: computed in one pass, so the LM head's weight is read once). `sample`
    is the ordinary sampler (it advances each state by the token it picks). Returns each entry's
    tokens for this step: the accepted drafts, then the first token that differed or the bonus."""
    offsets = [0]
    for d in drafts:
        offsets.append(offsets[-1] + len(d))
    out = [[r] for r in first]
    active = [i for i, d in enumerate(drafts) if d and first[i].token_id == d[0]]
    j = 1
    while active:  # the entries whose drafts 0 .. j - 1 were accepted: sample position j
        rows = [offsets[i] + j - 1 for i in active]
        results = sample(draft_logits[rows[0] : rows[0] + 1] if len(rows) == 1 else draft_logits[rows],
                         [states[i] for i in active])
        still = []
        for i, r in zip(active, results):
            out[i].append(r)
            if j < len(drafts[i]) and r.token_id == drafts[i][j]:
                still.append(i)
        active, j = still, j + 1
    for i, d in enumerate(drafts):
        if d:
            stats.record(len(d), len(out[i]) - 1)
    return out
