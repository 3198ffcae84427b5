"""`POST /v1/chat/completions`: the messages (text content only) go to the model's chat template
in the backend, with vLLM's template options; tool calls as tools.py finds or forces them."""

from __future__ import annotations

from typing import Any

import pier.frontends.http.openai.tools as tools
from pier.contract import llm
from pier.frontends.http.openai.endpoint import Call, Endpoint, Plan
from pier.frontends.http.openai.llm_io import Delta
from pier.frontends.http.openai.logprobs import chat_logprobs
from pier.frontends.http.openai.protocol import BadRequest


def check_messages(messages: Any) -> list[Any]:
    """Each message: an object with a string role, and content that is a string, a list of text
    parts, or (assistant turns only) null; else a 400 naming the message."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list.", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'.", "messages")
        content = m.get("content")
        if isinstance(content, str) or (content is None and m["role"] == "assistant"):
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of content parts.", "messages")
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"messages[{i}].content has a '{kind}' part: this model takes text parts only.",
                                 "messages")
    return messages


def chat_payload(doc: dict[str, Any], messages: list[Any]) -> tuple[Any, str]:
    """What the LLM backend's chat_messages input carries: the messages, or, when the request sets
    template options (add_generation_prompt, continue_final_message, chat_template_kwargs, tools),
    an object with them; and the answer's role (as vLLM: the last message's without a generation prompt)."""
    if doc.get("chat_template") is not None:
        raise BadRequest("a chat_template in the request is not supported: the model's template is used.",
                         "chat_template")
    add = doc.get("add_generation_prompt", True)
    cont = doc.get("continue_final_message", False)
    kwargs = doc.get("chat_template_kwargs")
    for name, value in (("add_generation_prompt", add), ("continue_final_message", cont)):
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be a boolean.", name)
    # the options' other checks (both true, kwargs not an object) are the backend's (_render_chat)
    role = "assistant" if add else str(messages[-1]["role"])
    tools = doc.get("tools")  # only with tool_choice "none" here: rendered, as vLLM renders them by default
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of tool objects.", "tools")
    if add and not cont and not kwargs and not tools:
        return messages, role
    payload = {llm.CHAT_OPTION_MESSAGES: messages, llm.CHAT_OPTION_ADD_GENERATION_PROMPT: add,
               llm.CHAT_OPTION_CONTINUE_FINAL_MESSAGE: cont, llm.CHAT_OPTION_TEMPLATE_KWARGS: kwargs or {}}
    if tools:
        payload[llm.CHAT_OPTION_TOOLS] = tools
    return payload, role


class Chat(Endpoint):
    chat = True
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def plan(self, doc: dict[str, Any], sampling: dict[str, Any], logprobs: int | None) -> Plan:
        messages = check_messages(doc.get("messages"))
        payload, role = chat_payload(doc, messages)
        return Plan([""], payload, role)

    def logprobs(self, parts: list[dict[str, Any]], start: int = 0) -> dict[str, Any] | None:
        return chat_logprobs(parts)

    def content(self, text: str, role: str) -> dict[str, Any]:
        return {"message": {"role": role, "content": text}}

    def delta(self, item: Delta) -> dict[str, Any]:
        return {"delta": {"content": item["text"]} if item["text"] or not item["finish_reason"] else {}}

    def whole_choice(self, call: Call, index: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        if call.tools is None:
            return self.content(text, call.role), finish
        message, finish = tools.whole(call.tools, text, call.role, finish)
        return {"message": message}, finish

    def stream_delta(self, call: Call, item: Delta) -> tuple[dict[str, Any], str | None]:
        if call.tools is None:
            return self.delta(item), item["finish_reason"]
        delta, finish = tools.stream_delta(call.tools, call.tool_state, item["index"], item["text"],
                                           item["finish_reason"])
        return {"delta": delta}, finish

    def opening(self, call: Call, item: Delta) -> tuple[dict[str, Any], int] | None:
        """The role goes out first, with empty content (a named tool call: the call's header)."""
        delta = {"role": call.role, "content": ""} if call.tools is None else \
            tools.opening(call.tools, item["index"], call.role)
        return {"index": item["index"], "delta": delta, "logprobs": None, "finish_reason": None}, 0


CHAT = Chat()
