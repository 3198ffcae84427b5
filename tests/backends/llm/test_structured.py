"""Structured output in the engine: on a random-weight model, every output follows its grammar by
construction (JSON Schema, json_object, regex, choice, Lark and GBNF grammars), with n > 1, many
seeds, greedy and sampled, under preemption; bad or unsatisfiable constraints are refused up front."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams
from pier.backends.llm.structured import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "ok", "color", "count", "tags"],
    "additionalProperties": False,
}


def _texts(eng: LLMEngine, prompt: list[int], params: SamplingParams, rid: str = "r",
           bounded: bool = True) -> dict[int, str]:
    """Each sequence's text. `bounded`: the grammar's documents are short, so each must end on EOS;
    else those cut by max_tokens are left out (an open JSON object can go on for ever)."""
    eng.add_request(rid, prompt, params)
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    while eng.has_unfinished():
        for out in eng.step():
            texts[out.index] = texts.get(out.index, "") + out.text
            if out.finished:
                finish[out.index] = out.finish_reason
    if bounded:
        assert set(finish.values()) == {"stop"}, finish  # every one ended on EOS, not the length limit
    return {i: t for i, t in texts.items() if finish[i] == "stop"}


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))


@pytest.mark.slow
def test_json_schema_outputs_validate_for_many_seeds_and_n(engine, prompts):
    so = {"json": SCHEMA}
    for seed in range(12):
        params = SamplingParams.from_json({"max_tokens": 200, "temperature": 1.0, "seed": seed, "n": 3,
                                           "structured_outputs": so})
        for text in _texts(engine, prompts[seed % len(prompts)], params, f"s{seed}").values():
            jsonschema.validate(json.loads(text), SCHEMA)
    greedy = SamplingParams.from_json({"max_tokens": 200, "temperature": 0, "structured_outputs": so})
    (text,) = _texts(engine, prompts[0], greedy, "g").values()
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_choice_and_grammars(engine, prompts):
    cases = [
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"regex": r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"},
         lambda t: re.fullmatch(r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", t) is not None),
        ({"choice": ["yes", "no", "mañana ☃"]}, lambda t: t in ("yes", "no", "mañana ☃")),
        ({"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'},
         lambda t: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", t) is not None),
        ({"grammar": 'root ::= "ab" | "cd" digit\ndigit ::= [0-9]'},  # GBNF, as vLLM's grammar field takes
         lambda t: re.fullmatch(r"ab|cd[0-9]", t) is not None),
    ]
    for i, (so, ok) in enumerate(cases):
        done = 0
        for seed in range(6):
            params = SamplingParams.from_json({"max_tokens": 120, "temperature": 1.0, "seed": seed,
                                               "structured_outputs": so})
            for text in _texts(engine, prompts[seed % len(prompts)], params, f"c{i}-{seed}",
                               bounded="json_object" not in so).values():
                assert ok(text), (so, text)
                done += 1
        assert done >= 3, so


def test_preempted_sequences_keep_their_grammar(llama_dir, prompts):
    """A KV budget of a few blocks preempts (recompute) and resumes requests mid-document."""
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=40 * 2048, block_size=4))
    params = SamplingParams.from_json({"max_tokens": 120, "temperature": 1.0, "seed": 1, "n": 2,
                                       "structured_outputs": {"json": SCHEMA}})
    for i, p in enumerate(prompts[:4]):
        eng.add_request(f"p{i}", p, params)
    texts: dict[tuple[str, int], str] = {}
    while eng.has_unfinished():
        for out in eng.step():
            key = (out.request_id, out.index)
            texts[key] = texts.get(key, "") + out.text
    assert eng.stats().num_preemptions > 0
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("so,word", [
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}},
               "required": ["a"]}}, "unsatisfiable"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "choice"),
    ({"json": SCHEMA, "regex": "a"}, "exactly one"),
    ({}, "exactly one"),
    ({"structural_tag": "x"}, "structural_tag"),
])
def test_bad_constraints_are_refused_up_front(engine, prompts, so, word):
    with pytest.raises(ValueError, match=f"(?i){word}"):
        engine.add_request("bad", prompts[0], SamplingParams.from_json({"structured_outputs": so}))
    assert not engine.has_unfinished()


def test_structured_outputs_round_trip_through_from_json():
    p = SamplingParams.from_json({"structured_outputs": {"choice": ["a", "b"]}})
    assert p.structured_outputs == StructuredOutputs("choice", '["a", "b"]')


def test_the_engine_core_starts_without_torch_compile() -> None:
    """Importing the engine (what every engine core start and restart does) leaves torch._dynamo
    and inductor out: llguidance's torch helpers, which apply torch.compile at import, come with the
    first structured request. Importing them up front cost each core start about 3 s of CPU
    (6 s on 2 busy cores), and so every restart after a crash."""
    import subprocess
    import sys

    code = ("import sys, pier.backends.llm.engine, pier.backends.llm.engine_core; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'llguidance.torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
