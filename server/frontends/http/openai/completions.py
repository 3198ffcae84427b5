"""`POST /v1/completions`: a prompt (text or token ids) or a batch of them, each its own request to
the model; `echo` puts the prompt (and, with logprobs, its tokens' logprobs) before the text."""

from __future__ import annotations

from typing import Any

from pier.contract import llm
from pier.frontends.http.openai.endpoint import Call, Endpoint, Plan, choice
from pier.frontends.http.openai.llm_io import Delta
from pier.frontends.http.openai.logprobs import completion_logprobs, text_length
from pier.frontends.http.openai.protocol import BadRequest

MAX_PROMPTS = 1024  # prompts in one completions request


def check_prompts(prompt: Any) -> list[str | list[int]]:
    """A completions `prompt`: a string, a list of token ids, or a list of either (a batch)."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str) or ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        prompts = prompt
    else:
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either.", "prompt")
    if any(p == "" for p in prompts):  # as vLLM (the BOS token alone is no prompt)
        raise BadRequest("The decoder prompt cannot be empty.", "prompt")
    if len(prompts) > MAX_PROMPTS:  # each is a request of its own: a bound on what one call can queue
        raise BadRequest(f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request.", "prompt")
    for p in prompts:
        bad = next((t for t in p if not 0 <= t < 2**63), None) if isinstance(p, list) else None
        if bad is not None:
            raise BadRequest(f"token id {bad} in prompt is out of range.", "prompt")
    return prompts


class Completions(Endpoint):
    chat = False
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def plan(self, doc: dict[str, Any], sampling: dict[str, Any], logprobs: int | None) -> Plan:
        if doc.get("suffix"):
            raise BadRequest("suffix is not supported by this server.", "suffix")
        prompts = check_prompts(doc.get("prompt"))
        echo: list[str | None] = []
        if doc.get("echo"):
            # The prompt's tokens get logprobs too (lm-eval's loglikelihood pattern); a token-id
            # prompt's text comes back with them (the backend decodes it).
            if logprobs is not None or not all(isinstance(p, str) for p in prompts):
                sampling[llm.SAMPLING_PROMPT_LOGPROBS] = logprobs or 0
            echo = [p if isinstance(p, str) else None for p in prompts]
        return Plan(prompts, echo=echo)

    def logprobs(self, parts: list[dict[str, Any]], start: int = 0) -> dict[str, Any] | None:
        return completion_logprobs(parts, start)

    def text_length(self, logprobs: dict[str, Any] | None) -> int:
        return text_length(logprobs)

    def content(self, text: str, role: str) -> dict[str, Any]:
        return {"text": text}

    def delta(self, item: Delta) -> dict[str, Any]:
        return {"text": item["text"]}

    def opening(self, call: Call, item: Delta) -> tuple[dict[str, Any], int] | None:
        """With echo, the prompt goes out first, as its own chunk (with its logprobs when asked)."""
        if not call.echo:
            return None
        i, part = item["index"], item["prompt_logprobs"]
        if part:
            call.fill_echo(i, part)
        prompt_lp = completion_logprobs([part] if part and llm.LOGPROBS_ENTRIES in part else [])
        return choice(i, {"text": call.echo[i] or ""}, prompt_lp, None, None), text_length(prompt_lp)


COMPLETIONS = Completions()
