"""Tool calling on `/v1/chat/completions`: `tools` and `tool_choice` as OpenAI and vLLM read them.

- `tool_choice` naming a function, or `"required"`: the output is constrained (structured output)
  to that function's arguments, or to a JSON list of calls to the tools offered (vLLM's shape:
  `[{"name": ..., "parameters": {...}}]`), so the calls parse and validate by construction.
- `"auto"` (the default when tools are sent): the model writes free text, and the model's
  `tool_call_parser` (a config.pbtxt parameter, vLLM's `--tool-call-parser` names: `hermes`,
  `llama3_json`, `mistral`) finds the calls in it; a model without one refuses tools unless
  `tool_choice` is `"none"` or forces a call.
- `"none"`: the tools reach the chat template only.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pier.contract.llm import TOOL_CALL_PARSERS as PARSERS
from pier.frontends.http.openai.protocol import BadRequest


@dataclass
class ToolPlan:
    mode: str  # "named", "required" or "auto"
    names: list[str]
    parser: str | None = None  # auto: how calls are found in the text
    name: str = ""  # named: the function
    call_ids: dict[int, str] = field(default_factory=dict)  # named, streamed: each choice's call id

    def call_id(self, choice: int) -> str:
        if choice not in self.call_ids:
            self.call_ids[choice] = new_call_id()
        return self.call_ids[choice]


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, each tool checked."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.",
                             "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
        out[fn["name"]] = params
    return out


def plan(doc: dict[str, Any], parser: str | None) -> tuple[ToolPlan | None, dict[str, Any] | None]:
    """The request's tool mode and, for forced calls, the structured_outputs constraint."""
    tools = doc.get("tools")
    choice = doc.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools.", "tool_choice")
        return None, None
    functions = _functions(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None, None
    if doc.get("response_format") is not None or doc.get("structured_outputs") is not None:
        raise BadRequest("tools with tool_choice other than 'none' cannot be combined with response_format or "
                         "structured_outputs.", "tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in functions:
            raise BadRequest(f"tool_choice names function {name!r}, which is not among the tools.", "tool_choice")
        return ToolPlan("named", list(functions), name=name), {"json": functions[name]}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for n, p in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return ToolPlan("required", list(functions)), {"json": schema}
    if choice != "auto":
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}.", "tool_choice")
    if parser is None:  # vLLM without --enable-auto-tool-choice answers the same way
        raise BadRequest("\"auto\" tool choice needs a tool call parser: this model has none (config parameter "
                         f"tool_call_parser: one of {', '.join(PARSERS)}). Send tool_choice \"none\", \"required\" "
                         "or a named function.", "tool_choice")
    return ToolPlan("auto", list(functions), parser=parser), None


# ---- finding calls in the text ------------------------------------------------------------------

Call = tuple[str, str]  # (function name, arguments as JSON text)


def _call(obj: Any, names: list[str], args_keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _json_values(text: str) -> list[Any]:
    """The JSON values one after another in `text` (separated by whitespace, ';' or ','), or []
    when anything else is there."""
    decoder, i = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return []
        out.append(value)


def parse(parser: str, text: str, names: list[str]) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer, as vLLM's parsers of that name read it. Text that
    holds no well-formed call to an offered tool is content, unchanged."""
    if parser == "hermes":
        found = _HERMES.findall(text)
        calls = [c for c in (_call(v, names) for raw in found for v in _json_values(raw)[:1]) if c]
        if not calls:
            return text, []
        content = _HERMES.sub("", text).strip()
        return content or None, calls
    if parser == "mistral":
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return text, []
        values = _json_values(rest)
        items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
        calls = [c for c in (_call(v, names) for v in items) if c]
        return (head.strip() or None, calls) if calls else (text, [])
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>")
        values = _json_values(body) if body.startswith("{") else []
        calls = [c for c in (_call(v, names) for v in values) if c]
        return (None, calls) if calls and len(calls) == len(values) else (text, [])
    raise ValueError(f"unknown tool call parser {parser!r}")


def required_calls(text: str, names: list[str]) -> list[Call]:
    """tool_choice "required": the constrained output, a JSON list of {name, parameters}."""
    try:
        items = json.loads(text)
    except ValueError:
        return []  # cut short by max_tokens
    if not isinstance(items, list):
        return []
    return [c for c in (_call(v, names) for v in items) if c]


def as_tool_calls(calls: list[Call]) -> list[dict[str, Any]]:
    return [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
            for name, args in calls]


class StreamParser:
    """auto, streamed: content goes out as it comes until text that may start a call; from there
    the rest is held back and, at the end, parsed: its calls go out as one tool_calls delta (what
    was no call after all goes out as content). Works whatever the chunk boundaries."""

    _MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}

    def __init__(self, parser: str, names: list[str]) -> None:
        self.parser, self.names = parser, names
        self.held = ""
        self.holding = False  # a call may have started: everything from there waits for the end
        self.started = False  # some content went out (llama3_json: a call can only open the answer)

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """(content to send now, the calls, at the end)."""
        self.held += text
        content = ""
        if not self.holding:
            if self.parser == "llama3_json":  # a call can only be the whole answer
                lead = self.held.lstrip()
                if not self.started and lead.startswith(("{", "<|python_tag|>")):
                    self.holding = True
                elif not self.started and not final and (not lead or "<|python_tag|>".startswith(lead)):
                    return "", []  # blanks, or a partial <|python_tag|>: wait
                else:
                    content, self.held = self.held, ""
            else:
                marker = self._MARKERS[self.parser]
                at = self.held.find(marker)
                if at >= 0:
                    content, self.held, self.holding = self.held[:at], self.held[at:], True
                else:  # hold back what could be the marker's beginning
                    keep = 0 if final else next((k for k in range(min(len(marker) - 1, len(self.held)), 0, -1)
                                                 if marker.startswith(self.held[-k:])), 0)
                    content, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.started = self.started or bool(content.strip())
        if not final or not self.holding:
            return content, []
        rest, calls = parse(self.parser, self.held, self.names)
        self.held = ""
        return content + (rest or ""), calls


# ---- the answer's shape -------------------------------------------------------------------------

def whole(plan_: ToolPlan, text: str, role: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message and finish_reason."""
    if plan_.mode == "named":
        call = {"id": new_call_id(), "type": "function", "function": {"name": plan_.name, "arguments": text}}
        return {"role": role, "content": None, "tool_calls": [call]}, finish  # OpenAI: "stop" when forced
    if plan_.mode == "required":
        content, calls = (None, required_calls(text, plan_.names))
        if not calls:
            content = text
    else:
        content, calls = parse(plan_.parser or "", text, plan_.names)
    message: dict[str, Any] = {"role": role, "content": content}
    if calls:
        message["tool_calls"] = as_tool_calls(calls)
        if finish == "stop":
            finish = "tool_calls"
    return message, finish


def stream_delta(plan_: ToolPlan, state: dict[int, Any], index: int, text: str,
                 finish: str | None) -> tuple[dict[str, Any], str | None]:
    """One streamed chunk's delta (and finish_reason) for choice `index`."""
    if plan_.mode == "named":  # the arguments stream as they come (the opening chunk named the call)
        return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), finish
    if plan_.mode == "required":
        state[index] = state.get(index, "") + text
        if finish is None:
            return {}, None
        calls = required_calls(state.pop(index), plan_.names)
        content, delta_calls = (None, calls) if calls else (None, [])
    else:
        parser = state.setdefault(index, StreamParser(plan_.parser or "", plan_.names))
        content, delta_calls = parser.feed(text, finish is not None)
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if delta_calls:
        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(as_tool_calls(delta_calls))]
        if finish == "stop":
            finish = "tool_calls"
    return delta, finish


def opening(plan_: ToolPlan, index: int, role: str) -> dict[str, Any]:
    """The first chunk's delta of a streamed choice."""
    if plan_.mode == "named":
        return {"role": role, "content": None, "tool_calls": [{"index": 0, "id": plan_.call_id(index), "type":
                                                              "function", "function": {"name": plan_.name,
                                                                                       "arguments": ""}}]}
    return {"role": role, "content": ""}
