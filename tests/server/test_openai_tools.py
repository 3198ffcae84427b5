"""The tool-call parsers (hermes, llama3_json, mistral) on fixed model texts, whole and streamed in
chunks split at every awkward boundary, and the request checks of tools / tool_choice."""

from __future__ import annotations

import json
import random
import re

import pytest

from pier.frontends.http.openai import tools
from pier.frontends.http.openai.protocol import BadRequest

NAMES = ["get_weather", "add"]
W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'

CASES = [
    # (parser, text, content, [(name, arguments)])
    ("hermes", f"Let me look.\n<tool_call>\n{W}\n</tool_call>", "Let me look.",
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", f"<tool_call>{W}</tool_call>\n<tool_call>{{\"name\": \"add\", \"arguments\": {{\"a\": 1, \"b\": 2}}}}"
               "</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]),
    ("hermes", "No tools needed: 2 < 3 and <tool_ is not a tag.", "No tools needed: 2 < 3 and <tool_ is not a tag.",
     []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>', []),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', None, [("add", {"a": 1, "b": 2})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": "{\\"a\\": 5}"}]', "Sure.", [("add", {"a": 5})]),
    ("mistral", "[TOOL and other text", "[TOOL and other text", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}',
     None, [("add", {"a": 1}), ("add", {"a": 2})]),
    ("llama3_json", 'The JSON {"name": "add"} is in the middle.', 'The JSON {"name": "add"} is in the middle.', []),
    ("llama3_json", "plain answer", "plain answer", []),
]


def _decoded(calls):
    return [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_texts(parser, text, content, calls):
    got_content, got_calls = tools.parse(parser, text, NAMES)
    assert (got_content, _decoded(got_calls)) == (content, calls)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_streamed_in_any_chunks_equals_whole(parser, text, content, calls):
    rng = random.Random(len(text))
    splits = [[1] * len(text), [len(text)]] + [[rng.randint(1, 6) for _ in range(len(text))] for _ in range(20)]
    for sizes in splits:
        stream = tools.StreamParser(parser, NAMES)
        out, got, i = "", [], 0
        pieces = []
        for size in sizes:
            if i >= len(text):
                break
            pieces.append(text[i:i + size])
            i += size
        for k, piece in enumerate(pieces):
            c, new = stream.feed(piece, final=k == len(pieces) - 1)
            out += c
            got += new
        expected = content or ""
        if calls:  # streamed, the text before a call went out as it came (whitespace included)
            assert out.strip() == expected, (sizes, out)
        else:
            assert out == text, (sizes, out)
        assert _decoded(got) == calls


def test_plans():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    plan, forced = tools.plan({"tools": [weather], "tool_choice": {"type": "function",
                                                                   "function": {"name": "get_weather"}}}, None)
    assert plan.mode == "named" and forced == {"json": weather["function"]["parameters"]}
    plan, forced = tools.plan({"tools": [weather], "tool_choice": "required"}, None)
    assert plan.mode == "required" and forced["json"]["minItems"] == 1
    assert tools.plan({"tools": [weather], "tool_choice": "none"}, None) == (None, None)
    plan, forced = tools.plan({"tools": [weather]}, "hermes")
    assert plan.mode == "auto" and plan.parser == "hermes" and forced is None
    for doc, word in (({"tools": [weather]}, "tool call parser"),
                      ({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
                      ({"tools": [{"type": "function"}]}, "tools[0]"),
                      ({"tool_choice": "required"}, "needs tools"),
                      ({"tools": [weather], "tool_choice": "sometimes"}, "tool_choice must be"),
                      ({"tools": [weather], "tool_choice": "required", "response_format": {"type": "json_object"}},
                       "cannot be combined")):
        with pytest.raises(BadRequest, match=re.escape(word)):
            tools.plan(doc, None)


def test_answers_take_openai_shapes():
    named = tools.ToolPlan("named", NAMES, name="add")
    message, finish = tools.whole(named, '{"a": 1}', "assistant", "stop")
    assert message["content"] is None and finish == "stop"
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert message["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    required = tools.ToolPlan("required", NAMES)
    message, finish = tools.whole(required, '[{"name": "add", "parameters": {"a": 3}}]', "assistant", "stop")
    assert finish == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 3}
    message, finish = tools.whole(required, '[{"name": "add", "param', "assistant", "length")  # cut short
    assert "tool_calls" not in message and finish == "length"
