"""The LLM tensor protocol's logprobs documents (pier.contract.llm: LOGPROBS, PROMPT_LOGPROBS): each
token's text as it reads in place, its logprob and the best alternatives, decoded with the model's
tokenizer on the server's side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pier.contract import llm

CONTEXT_TOKENS = 4  # tokens decoded before a logprob token, for its leading space and pending bytes


def alone_text(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False)).replace("\ufffd", "")


def logprobs_doc(tokenizer: Any, ids: Sequence[int], entries: Sequence[tuple[float | None, Any]],
                 context: Sequence[int]) -> dict[str, Any]:
    """{"tokens": [text of each id], "ids": [...], "logprobs": [[logprob, [[alternative text,
    logprob, id], ...]] or None]}: the logprobs and prompt_logprobs outputs (None: a prompt's first token has no
    logprob). A token's text is what it adds to the text after `context` and the ids before it
    ('' for a byte that only starts a character, the whole character for the byte that ends it,
    as vLLM); alternatives are decoded alone, best first."""
    def ranked(top: dict[int, float] | None) -> list[list[Any]]:
        best = sorted((top or {}).items(), key=lambda kv: -kv[1])
        return [[alone_text(tokenizer, t), v, t] for t, v in best]

    return {llm.LOGPROBS_TOKENS: token_texts(tokenizer, ids, context), llm.LOGPROBS_IDS: list(ids),
            llm.LOGPROBS_ENTRIES: [None if lp is None else [lp, ranked(top)] for lp, top in entries]}

def token_texts(tokenizer: Any, ids: Sequence[int], context: Sequence[int]) -> list[str]:
    """Each token's text in place: decode a short window ending at it and take what it adds to
    the window before it (whole characters only)."""
    def text(window: list[int]) -> str:
        return tokenizer.decode(window, skip_special_tokens=False).rstrip("\ufffd")

    window = list(context[-CONTEXT_TOKENS:])
    before = text(window)
    out: list[str] = []
    for t in ids:
        window.append(t)
        after = text(window)
        out.append(after[len(before):] if after.startswith(before) else alone_text(tokenizer, t))
        before = after
        if len(window) > 2 * CONTEXT_TOKENS and after == tokenizer.decode(
                window, skip_special_tokens=False):  # no character pending: the window may slide
            window = window[-CONTEXT_TOKENS:]
            before = text(window)
    return out
