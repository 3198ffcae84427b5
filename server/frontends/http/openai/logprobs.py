"""The backend's LOGPROBS documents (pier.contract.llm) in OpenAI's shapes: chat's `content`
entries, completions' parallel lists with text offsets."""

from __future__ import annotations

from typing import Any

from pier.contract import llm


def _flatten(parts: list[dict[str, Any]]) -> tuple[list[str], list[Any]]:
    """Every part's tokens, and their (logprob, alternatives) entries ((None, None): a prompt's
    first token)."""
    tokens = [t for p in parts for t in p[llm.LOGPROBS_TOKENS]]
    entries = [e or (None, None) for p in parts for e in p[llm.LOGPROBS_ENTRIES]]
    return tokens, entries


def chat_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Chat: an entry per token with every alternative, best first."""
    if not parts:
        return None
    tokens, entries = _flatten(parts)
    return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                          for t, v, *_ in top or []]}
                        for tok, (lp, top) in zip(tokens, entries)]}


def completion_logprobs(parts: list[dict[str, Any]], start: int = 0) -> dict[str, Any] | None:
    """Completions: text offsets from `start`; top_logprobs is a {token: logprob} object
    (alternatives whose texts coincide share a key, as in vLLM's) that holds the chosen token too."""
    if not parts:
        return None
    tokens, entries = _flatten(parts)
    offsets, pos = [], start
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    tops: list[dict[str, float] | None] = []
    for tok, (lp, top) in zip(tokens, entries):
        alternatives = {t: v for t, v, *_ in top or []}
        tops.append(None if lp is None else alternatives if tok in alternatives else {**alternatives, tok: lp})
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}


def text_length(logprobs: dict[str, Any] | None) -> int:
    """The characters a completions logprobs object's tokens spell (where the next one's offsets start)."""
    return sum(len(t) for t in logprobs["tokens"]) if logprobs else 0
