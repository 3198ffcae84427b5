"""The chat_messages input of the LLM tensor protocol rendered to a prompt with the model's chat
template, as vLLM renders OpenAI chat requests (string content, the `developer` role, template
options: add_generation_prompt, continue_final_message, chat_template_kwargs, tools)."""

from __future__ import annotations

from typing import Any

from pier.contract import llm

_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def _plain_message(message: Any) -> dict[str, Any]:
    """A message as string-content chat templates expect it, as vLLM renders them: content given as
    a list of text parts is their texts joined by newlines, null content is empty, and the
    `developer` role (OpenAI's newer name) is `system`."""
    if not isinstance(message, dict):
        raise ValueError("each message must be an object")
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        texts = [p["text"] for p in content
                 if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
        if len(texts) != len(content):
            raise ValueError("message content parts must be text parts ({'type': 'text', 'text': ...})")
        out["content"] = "\n".join(texts)
    if out.get("role") == "developer":
        out["role"] = "system"
    return out


def render_chat(tokenizer: Any, doc: Any) -> str:
    """chat_messages: a list of messages, or {"messages", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "tools"} (the OpenAI frontend's template options).
    continue_final_message renders without a generation prompt and ends the text right after the
    last message's content, so the model continues it."""
    options: dict[str, Any] = doc if isinstance(doc, dict) else {llm.CHAT_OPTION_MESSAGES: doc}
    messages = options.get(llm.CHAT_OPTION_MESSAGES)
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    add = bool(options.get(llm.CHAT_OPTION_ADD_GENERATION_PROMPT, True))
    cont = bool(options.get(llm.CHAT_OPTION_CONTINUE_FINAL_MESSAGE, False))
    kwargs = options.get(llm.CHAT_OPTION_TEMPLATE_KWARGS) or {}
    if not isinstance(kwargs, dict) or _TEMPLATE_NAMES & kwargs.keys():
        raise ValueError(f"chat_template_kwargs must be an object without {sorted(_TEMPLATE_NAMES)}")
    if add and cont:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    tools = options.get(llm.CHAT_OPTION_TOOLS)
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list")
    messages = [_plain_message(m) for m in messages]
    if tools:  # the template shows the model the tools (as HF's apply_chat_template(tools=...))
        kwargs = {**kwargs, "tools": tools}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add, **kwargs)
    final = messages[-1].get("content")
    if cont and isinstance(final, str) and final and (at := text.rfind(final)) >= 0:
        text = text[: at + len(final)]
    return text
