"""Structured output: a request's `structured_outputs` (vLLM's names: json, json_object, regex,
choice, grammar) compiled by llguidance into a token matcher per sequence, whose mask the sampler
applies at every step, so the output is valid by construction (prompting alone is not).

llguidance rather than xgrammar or outlines-core: a small Rust wheel with no dependencies (no
torch build, no CUDA kernels needed on CPU), JSON Schema, regex and Lark grammars in one
compiler, masks in tens of microseconds per token on the vocabularies here, and lazy grammar
compilation (no per-schema start-up cost). The JSON it allows is compact (no free whitespace): a
model cannot pad a document with endless blanks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# What structured_outputs may carry besides its one kind (vLLM's fields): no effect here.
_OPTIONS = {"disable_fallback", "disable_additional_properties", "backend"}


@dataclass(frozen=True)
class StructuredOutputs:
    """One request's constraint: `kind` (one of KINDS) and its value (JSON text for a schema)."""

    kind: str
    value: str

    @classmethod
    def from_json(cls, obj: Any) -> StructuredOutputs:
        """vLLM's `structured_outputs` object; raises ValueError naming what is wrong."""
        if not isinstance(obj, Mapping):
            raise ValueError("structured_outputs must be an object")
        unknown = sorted(set(obj) - set(KINDS) - _OPTIONS)
        if unknown:
            raise ValueError(f"structured_outputs has unsupported fields: {', '.join(unknown)} (supported: "
                             f"{', '.join(KINDS)})")
        given = [k for k in KINDS if obj.get(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, grammar"
                             + (f" (got {', '.join(given)})" if given else ""))
        kind = given[0]
        value = obj[kind]
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(value, (Mapping, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            return cls(kind, json.dumps(value))
        if kind == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be true")
            return cls(kind, "")
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            return cls(kind, json.dumps(value))
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        return cls(kind, value)

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form)."""
        if self.kind in ("json", "json_object"):
            schema = json.loads(self.value) if self.kind == "json" else {"type": "object"}
            if isinstance(schema, dict):  # compact separators, no free whitespace
                schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_flexible": False}}
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in json.loads(self.value)))
        text = self.value
        if "::=" in text:  # GBNF (llama.cpp / xgrammar's EBNF, what vLLM's grammar field takes)
            text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
        return llguidance.LLMatcher.grammar_from_lark(text)


class GrammarCompiler:
    """Per engine: the tokenizer llguidance masks against, and a matcher per sequence."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._json, self._vocab, self._eos = tokenizer_json, vocab_size, list(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # built on the first structured request
            self._tokenizer = llguidance.LLTokenizer(self._json, n_vocab=self._vocab, eos_token=self._eos or None)
        return self._tokenizer

    def check(self, spec: StructuredOutputs) -> None:
        """Raise ValueError when the constraint cannot be compiled or can never be satisfied."""
        try:
            grammar = spec.grammar()
        except Exception as exc:  # llguidance raises its own error types for a bad schema or regex
            raise ValueError(f"structured_outputs.{spec.kind} is not supported: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{spec.kind} is not supported: {error}")

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, spec.grammar())


def _llg_torch() -> Any:
    """llguidance's torch helpers, imported on the first structured request: the module applies
    `torch.compile` at import, which pulls in torch._dynamo and inductor (about 3 s of CPU, 6 s on
    2 busy cores) that every LLM engine core start, and so every restart after a crash, would
    otherwise pay for a feature most requests never use."""
    import llguidance.torch as llg_torch

    return llg_torch


def grammar_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """The tokens each matcher allows now, one bitmask row per matcher ([len, ceil(vocab / 32)] int32)."""
    llg_torch = _llg_torch()
    bitmask = llg_torch.allocate_token_bitmask(len(matchers), vocab_size)
    for j, matcher in enumerate(matchers):
        llg_torch.fill_next_token_bitmask(matcher, bitmask, j)
    return bitmask


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, eos_id: int | None) -> None:
    """Mask `logits` rows (in place) to the tokens their bitmask rows allow. A row left with no
    allowed token (its grammar is done and min_tokens hides EOS, say) keeps EOS, so it ends."""
    index = torch.tensor(rows, device=logits.device)
    sub = logits[index]
    _llg_torch().apply_token_bitmask_inplace(sub, bitmask.to(logits.device))
    if eos_id is not None:
        dead = ~torch.isfinite(sub).any(dim=-1)
        if bool(dead.any()):
            sub[dead, eos_id] = 0.0
    logits[index] = sub
