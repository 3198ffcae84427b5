"""What completions and chat each define (Endpoint: their request fields, and their choices'
shapes), what one call of either carries while it answers (Call), and the choice shape both
share. The steps they share (checks, requests, merging, whole answers, streams) use these."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from pier.contract import llm
from pier.frontends.http.openai.llm_io import Delta


@dataclass
class Plan:
    """What a call asks the backend: one inference request per prompt (chat: one, with `messages`,
    the chat_messages input)."""

    prompts: list[str | list[int]]
    messages: Any = None
    role: str = "assistant"  # chat: the answer's role (the last message's when no generation prompt is added)
    # completions `echo`: each prompt's text (None: a token-id prompt's, from the model)
    echo: list[str | None] = field(default_factory=list)
    tools: Any = None  # chat: tools.ToolPlan when the answer may hold tool calls


@dataclass
class Call:
    """One call while it answers; choice k is sequence k % per_prompt of prompt k // per_prompt."""

    endpoint: Endpoint
    ident: str
    created: int
    model: str
    prompt_tokens: int
    choices: int
    per_prompt: int
    role: str
    echo: list[str | None]  # per choice: its prompt's text (None: from the model, not yet known); [] without echo
    tools: Any = None  # chat: tools.ToolPlan, or None
    asked: str = ""  # the model the request named, when an overloaded one handed it to `model` (its fallback)
    tool_state: dict[int, Any] = field(default_factory=dict)  # streamed tool calls: per choice

    @property
    def headers(self) -> dict[str, str]:
        """The answer's own headers: x-pier-fallback-from when the fallback answered."""
        return {llm.FALLBACK_FROM_HEADER: self.asked} if self.asked else {}

    def fill_echo(self, i: int, part: dict[str, Any]) -> None:
        """A token-id prompt's echo text, from the model's decoding of it (`part`: the prompt_logprobs
        document), for every choice of that prompt."""
        first = i - i % self.per_prompt
        for j in range(first, min(first + self.per_prompt, len(self.echo))):
            if self.echo[j] is None:
                self.echo[j] = part.get(llm.PROMPT_TEXT, "")


def choice(index: int, content: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None,
           stop_reason: Any) -> dict[str, Any]:
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


class Endpoint(abc.ABC):
    chat: bool
    object: str  # the whole answer's "object"
    chunk_object: str  # a stream chunk's
    id_prefix: str

    @abc.abstractmethod
    def plan(self, doc: dict[str, Any], sampling: dict[str, Any], logprobs: int | None) -> Plan:
        """The endpoint's own request fields, checked (BadRequest); may add to `sampling`."""

    @abc.abstractmethod
    def logprobs(self, parts: list[dict[str, Any]], start: int = 0) -> dict[str, Any] | None:
        """LOGPROBS documents in the endpoint's shape (`start`: the text offset they begin at)."""

    def text_length(self, logprobs: dict[str, Any] | None) -> int:
        """How far `logprobs` moves the text offset of the next ones."""
        return 0

    @abc.abstractmethod
    def content(self, text: str, role: str) -> dict[str, Any]:
        """A whole choice's content fields."""

    @abc.abstractmethod
    def delta(self, item: Delta) -> dict[str, Any]:
        """A stream chunk's content fields for one delta."""

    def whole_choice(self, call: Call, index: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's content fields and finish_reason."""
        return self.content(text, call.role), finish

    def stream_delta(self, call: Call, item: Delta) -> tuple[dict[str, Any], str | None]:
        """A stream chunk's content fields and finish_reason."""
        return self.delta(item), item["finish_reason"]

    @abc.abstractmethod
    def opening(self, call: Call, item: Delta) -> tuple[dict[str, Any], int] | None:
        """The chunk a streamed choice starts with, before its first delta (`item`), if any, and the
        text offset it leaves."""
