"""A request's checks before it is queued, and its prompt as token ids (vLLM's input processor).

Every check reads fixed settings only, so callers run them on their own thread (or process): the
async client tokenizes and checks on the caller's side, the engine checks again when it queues.
Each refusal is a ValueError whose message names the problem (vLLM's words where vLLM has them).
"""

from __future__ import annotations

from collections.abc import Sequence

from .sampling_params import SamplingParams
from .structured import GrammarCompiler
from .tokenizer import Tokenizer

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_STOP_STRINGS = 256
CHARS_PER_TOKEN_BOUND = 64


def check_text_length(text: str, max_model_len: int) -> None:
    """Refuse, before tokenizing, text far too long for the context: the tokenizer holds the GIL
    (a 20 MB prompt stalled every request for 30 s). The bound allows 64 characters a token."""
    if len(text) > max_model_len * CHARS_PER_TOKEN_BOUND:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"is {len(text)} characters long, more than that many tokens can hold "
            f"({CHARS_PER_TOKEN_BOUND} characters a token)."
        )


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int], max_model_len: int, vocab: int) -> list[int]:
    """Token ids for a prompt (text is tokenized with special tokens). Raises ValueError."""
    if isinstance(prompt, str):
        check_text_length(prompt, max_model_len)
    elif len(prompt) >= max_model_len:  # before converting a huge list
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains at least {len(prompt)} input tokens, leaving no room for output."
        )
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains at least {len(ids)} input tokens, leaving no room for output."
        )
    if any(t < 0 or t >= vocab for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    return ids


class InputProcessor:
    """The engine's request checks, against its model and settings."""

    def __init__(self, tokenizer: Tokenizer, grammars: GrammarCompiler, max_model_len: int, vocab_size: int,
                 max_num_seqs: int, priority_scheduling: bool) -> None:
        self.tokenizer, self.grammars = tokenizer, grammars
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.max_num_seqs, self.priority_scheduling = max_num_seqs, priority_scheduling

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.max_model_len, self.vocab_size)

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError when the engine cannot run `params` as asked."""
        if params.max_tokens is not None and params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} cannot be greater than max_model_len="
                             f"{self.max_model_len}. Please request fewer output tokens.")
        for kind, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if k is not None and k > MAX_LOGPROBS:  # a topk past the vocabulary would fail a step
                raise ValueError(f"Requested {kind} logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}")
        if params.n > self.max_num_seqs:  # all n sequences run at once, sharing the prompt
            raise ValueError(f"n={params.n} cannot be greater than max_num_seqs={self.max_num_seqs}.")
        vocab = self.vocab_size
        outside = sorted({t for t, _ in params.logit_bias if t >= vocab})
        if outside:
            raise ValueError(f"logit_bias has token ids outside the vocabulary (size {vocab}): {outside[:10]}")
        outside = sorted({t for t in params.stop_token_ids if not 0 <= t < vocab})
        if outside:
            raise ValueError(f"stop_token_ids has token ids outside the vocabulary (size {vocab}): {outside[:10]}")
        if len(params.stop) > MAX_STOP_STRINGS:  # each is searched for after every token, on the engine thread
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        if params.embed and params.n != 1:
            raise ValueError("an embedding request has one sequence (n must be 1)")
        if params.priority != 0 and not self.priority_scheduling:  # vLLM's words
            raise ValueError(f"Got priority {params.priority} but Priority scheduling is not enabled.")
