"""Speculative decoding with a draft model (vLLM's `speculative_config` {"model": ..., "num_speculative_tokens": K}).

The draft is a smaller model with the target's tokenizer, run by the same engine: it shares the
sequences' block tables but has KV caches of its own (the pool's blocks are sized for both models,
so the block accounting is the target's, exactly), and the model runner applies every block move
(swap, copy-on-write) to both. Each step, before the target's forward, `Drafter.propose`:
1. runs the draft over the step's known tokens (prompt chunks, plain decodes, and the last token of
   each sequence that drafts), so its KV follows the target's; its row of a drafting sequence gives
   the first draft (greedy: vLLM's default `draft_sample_method`, the draft distribution one-hot);
2. feeds each draft back, one position a pass, until the sequence has the K drafts the scheduler
   reserved positions for;
3. writes the drafts into the step, which the target verifies (spec_decode.verify).
The draft never sees the last draft of a step (nothing follows it); when the target accepts all K,
that token's draft KV is written in the sequence's next step, before its last token.

`check_tokenizers` refuses a draft whose tokenizer is not the target's: its vocabulary, its special
tokens, or the tokenizer itself (normaliser, pre-tokeniser, model, decoder) — vLLM checks only the
vocabulary's size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .scheduler_output import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from .models.interface import CausalLM, KVCache

# ModelRunner.forward: (step, model, its KV caches) -> (hidden, (row, seq) of each chunk that samples, ...)
Forward = Callable[[SchedulerOutput, "CausalLM", "list[KVCache]"], tuple[torch.Tensor, list[tuple[int, ScheduledSeq]],
                                                                         Any]]

_TOKENIZER_PARTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def draft_folder(model: str, served: Path) -> Path:
    """The draft's folder: `model` as given, a relative path taken from the served model's folder."""
    path = Path(model).expanduser()
    folder = path if path.is_absolute() else served / path
    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative_config: draft model {model!r}: no config.json in {folder}")
    return folder


def _tokenizer_json(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config: draft model: cannot read {path}: {exc}") from None


def _specials(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    out = {}
    for key in _SPECIAL_KEYS:
        value = cfg.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out


def check_tokenizers(target: Path, draft: Path) -> None:
    """ValueError naming what differs when the draft's tokenizer is not the target's."""
    a, b = _tokenizer_json(target), _tokenizer_json(draft)
    where = f"speculative_config: the draft model in {draft} has another tokenizer than the served model"
    ma, mb = a.get("model") or {}, b.get("model") or {}
    va, vb = ma.get("vocab") or {}, mb.get("vocab") or {}
    if va != vb:
        if len(va) != len(vb):
            raise ValueError(f"{where}: its vocabulary has {len(vb)} tokens, the served model's {len(va)}")
        ids_a = {i: t for t, i in va.items()} if isinstance(va, dict) else dict(enumerate(va))
        ids_b = {i: t for t, i in vb.items()} if isinstance(vb, dict) else dict(enumerate(vb))
        first = min(i for i in set(ids_a) | set(ids_b) if ids_a.get(i) != ids_b.get(i))
        raise ValueError(f"{where}: its vocabulary differs (token {first} is {ids_b.get(first)!r} in the draft, "
                         f"{ids_a.get(first)!r} in the served model)")
    added_a = sorted((t.get("id"), t.get("content"), bool(t.get("special"))) for t in a.get("added_tokens") or [])
    added_b = sorted((t.get("id"), t.get("content"), bool(t.get("special"))) for t in b.get("added_tokens") or [])
    if added_a != added_b:
        diff = sorted(set(added_a) ^ set(added_b))[:3]
        raise ValueError(f"{where}: its special (added) tokens differ, e.g. {diff}")
    sa, sb = _specials(target), _specials(draft)
    for key in _SPECIAL_KEYS:
        if sa[key] != sb[key]:
            raise ValueError(f"{where}: its {key} is {sb[key]!r}, the served model's {sa[key]!r}")
    for part in ("model", *_TOKENIZER_PARTS):
        if a.get(part) != b.get(part):
            raise ValueError(f"{where}: its {part.replace('_', '-')} differs ("
                             f"{_kind(b.get(part))} vs {_kind(a.get(part))})")


def _kind(part: Any) -> str:
    return str(part.get("type")) if isinstance(part, dict) else repr(part)


class Drafter:
    """The draft model's side of a step (see the module docstring). Runs inside the model runner,
    whose batch building (`ModelRunner.forward`, passed in) it reuses over its own model and KV caches."""

    def __init__(self, model: CausalLM, caches: list[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> None:
        self.model = model
        self.caches = caches
        self.vocab_size = vocab_size  # the target's: the draft proposes only tokens the target has
        # seq id -> (position, token) of this step's last draft, whose draft KV is not written;
        # moved to `unwritten` when the target accepts it (`verified`), written next step
        self.pending: dict[str, tuple[int, int]] = {}
        self.unwritten: dict[str, tuple[int, int]] = {}

    def verified(self, seq_id: str, all_accepted: bool) -> None:
        """The target's verdict on `seq_id`'s drafts of this step."""
        last = self.pending.pop(seq_id, None)
        if all_accepted and last is not None:
            self.unwritten[seq_id] = last

    def propose(self, forward: Forward, so: SchedulerOutput) -> None:
        """Fill in the draft tokens of `so`'s drafting sequences (placeholders from the scheduler)."""
        for sid in so.finished_seq_ids:
            self.unwritten.pop(sid, None)
        self.pending.clear()
        known = []
        for s in so.scheduled:
            n = len(s.token_ids) - len(s.draft_token_ids)
            ids, start = s.token_ids[:n], s.start_pos
            gap = self.unwritten.pop(s.seq_id, None)
            if gap is not None and gap[0] == start - 1:
                ids, start = [gap[1], *ids], start - 1
            known.append(replace(s, token_ids=ids, start_pos=start, prompt_logprobs=False, forks=[],
                                 draft_token_ids=[]))
        drafting = [s for s in so.scheduled if s.draft_token_ids]
        hidden, sampling, _ = forward(SchedulerOutput(scheduled=known), self.model, self.caches)
        if not drafting:
            return
        row_of = {s.seq_id: row for row, s in sampling}
        picks = self._pick(hidden, [row_of[s.seq_id] for s in drafting])
        j = 0
        while True:
            for s, t in zip(drafting, picks):
                s.draft_token_ids[j] = t
                s.token_ids[len(s.token_ids) - len(s.draft_token_ids) + j] = t
            j += 1
            for s in drafting:
                if len(s.draft_token_ids) == j:  # its last draft, at start_pos + j
                    self.pending[s.seq_id] = (s.start_pos + j, s.draft_token_ids[-1])
            drafting = [s for s in drafting if len(s.draft_token_ids) > j]
            if not drafting:
                return
            feed = [ScheduledSeq(s.seq_id, [s.draft_token_ids[j - 1]], s.start_pos + j, s.block_table, sample=True,
                                 group_tables=s.group_tables)
                    for s in drafting]
            hidden, sampling, _ = forward(SchedulerOutput(scheduled=feed), self.model, self.caches)
            row_of = {s.seq_id: row for row, s in sampling}
            picks = self._pick(hidden, [row_of[s.seq_id] for s in drafting])

    def _pick(self, hidden: torch.Tensor, rows: list[int]) -> list[int]:
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()
