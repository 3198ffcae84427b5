"""The LLM backend served by a real `pier serve`: a folder with only `backend: "llm"` and the HF
files auto-completes to Triton's vLLM-backend tensors; tritonclient gRPC streaming, HTTP
generate / generate_stream, and the openai SDK (completions, chat, streaming, usage, errors);
a client that disconnects mid-stream frees its KV blocks; vllm:* metrics."""

from __future__ import annotations

import json
import queue
import re
import socket
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.conftest import PierProcess, start_pier

pytestmark = pytest.mark.llm

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
grpcclient = pytest.importorskip("tritonclient.grpc")

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path_factory.mktemp("llm") / "repo"
    folder = build_model(repo / "tiny_llama" / "1", "llama")
    cfg = json.loads((folder / "tokenizer_config.json").read_text()) if (folder / "tokenizer_config.json").exists() \
        else {}
    cfg["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (repo / "tiny_llama" / "config.pbtxt").write_text(
        'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "8000000" } }\n')
    proc = start_pier([repo], f"--trace-config=triton,file={repo.parent / 'trace.json'}",
                      log_path=repo.parent / "pier.log", timeout=120)
    proc.trace_file = repo.parent / "trace.json"  # type: ignore[attr-defined]
    proc.model_dir = folder  # type: ignore[attr-defined]
    yield proc
    assert proc.stop() == 0, proc.log()


def generate(server: PierProcess, body: dict) -> dict:
    r = requests.post(f"{server.base()}/v2/models/tiny_llama/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_config_is_auto_completed(server: PierProcess) -> None:
    cfg = requests.get(f"{server.base()}/v2/models/tiny_llama/config").json()
    assert cfg["model_transaction_policy"]["decoupled"] is True
    inputs = {i["name"]: i for i in cfg["input"]}
    assert inputs["text_input"]["data_type"] == "TYPE_STRING" and not inputs["text_input"]["optional"]
    assert inputs["stream"]["data_type"] == "TYPE_BOOL" and inputs["stream"]["optional"]
    assert {"sampling_parameters", "exclude_input_in_output"} <= set(inputs)
    assert [o["name"] for o in cfg["output"]][0] == "text_output"


def test_generate_and_generate_stream_agree(server: PierProcess) -> None:
    prompt = "hello pier"
    whole = generate(server, {"text_input": prompt, "exclude_input_in_output": True,
                              "sampling_parameters": json.dumps(GREEDY)})
    assert whole["model_name"] == "tiny_llama" and whole["text_output"]
    with_prompt = generate(server, {"text_input": prompt, "parameters": GREEDY})  # sampling as parameters
    assert with_prompt["text_output"] == prompt + whole["text_output"]
    r = requests.post(f"{server.base()}/v2/models/tiny_llama/generate_stream", timeout=60, stream=True,
                      json={"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(GREEDY)})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[len(b"data: "):]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    # logprobs over generate, whole: one token text and one entry per generated token, the tokens
    # spelling the text (they were the last delta's tokens beside every token's logprobs)
    lp = generate(server, {"text_input": prompt, "exclude_input_in_output": True, "return_logprobs": True,
                           "sampling_parameters": json.dumps({**GREEDY, "logprobs": 2})})
    doc = json.loads(lp["logprobs"])
    assert len(doc["tokens"]) == len(doc["logprobs"]) == GREEDY["max_tokens"], doc
    assert "".join(doc["tokens"]) == lp["text_output"] == whole["text_output"]


def test_generate_errors(server: PierProcess) -> None:
    r = requests.post(f"{server.base()}/v2/models/tiny_llama/generate", timeout=30,
                      json={"text_input": "x", "sampling_parameters": json.dumps({"max_tokens": -3})})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]
    r = requests.post(f"{server.base()}/v2/models/tiny_llama/generate_stream", timeout=30,
                      json={"text_input": "x", "sampling_parameters": "{not json"})
    # the model's refusal, as its first response: 400 with the error as the stream's one event (Triton)
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert r.status_code == 400 and len(events) == 1 and "sampling_parameters" in events[0]["error"], r.text
    r = requests.post(f"{server.base()}/v2/models/tiny_llama/infer", timeout=30,
                      json={"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]}]})
    assert r.status_code == 501 and "decoupled transaction policy" in r.json()["error"]  # as Triton
    deep = "[" * 100_000 + "]" * 100_000
    for field in ("chat_messages", "sampling_parameters"):  # nested too deeply for json: a 400, not a 500
        r = requests.post(f"{server.base()}/v2/models/tiny_llama/generate", timeout=30,
                          json={"text_input": "x", field: deep})
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"], r.text[:300]
    # Streaming deltas cannot be one /generate answer: a 400, as Triton's "exactly 1 response" rule.
    r = requests.post(f"{server.base()}/v2/models/tiny_llama/generate", timeout=30,
                      json={"text_input": "x", "stream": True, "sampling_parameters": json.dumps(GREEDY)})
    assert r.status_code == 400 and "exactly 1 response" in r.json()["error"] and "generate_stream" in r.text
    assert generate(server, {"text_input": "x", "sampling_parameters": json.dumps(GREEDY)})["text_output"]
    for body, word in (({"text_input": {"a": 1}}, "non-string"), ({"text_input": None}, "non-string"),
                       ({"text_input": "x", "sampling_parameters": GREEDY}, "non-string"),  # as Triton: strings only
                       ({"text_input": "x", "input_ids": [1.5]}, "expected integers")):
        r = requests.post(f"{server.base()}/v2/models/tiny_llama/generate", json=body, timeout=30)
        assert r.status_code == 400 and word in r.json()["error"], (body, r.text)


def test_grpc_stream_with_tritonclient(server: PierProcess) -> None:
    expected = generate(server, {"text_input": "stream me", "exclude_input_in_output": True,
                                 "sampling_parameters": json.dumps(GREEDY)})["text_output"]
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    inputs = []
    sampling = np.array([json.dumps(GREEDY).encode()], dtype=object)
    for name, datatype, value in (("text_input", "BYTES", np.array([b"stream me"], dtype=object)),
                                  ("stream", "BOOL", np.array([True])),
                                  ("sampling_parameters", "BYTES", sampling)):
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    client.async_stream_infer("tiny_llama", inputs, request_id="s1")
    pieces: list[str] = []
    while True:
        result, error = answers.get(timeout=60)
        assert error is None, error
        pieces.append(result.as_numpy("text_output")[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    # A request the model refuses on validation (wrong input shape) is an in-band error naming the
    # problem, not an "internal error", and the stream carries on.
    bad = grpcclient.InferInput("text_input", [2], "BYTES")
    bad.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    client.async_stream_infer("tiny_llama", [bad], request_id="bad")
    result, error = answers.get(timeout=60)
    assert error is not None and "internal error" not in str(error) and "shape" in str(error), error
    client.async_stream_infer("tiny_llama", inputs, request_id="s2")
    result, error = answers.get(timeout=60)
    assert error is None and result.get_response().id == "s2"
    client.stop_stream()
    assert len(pieces) == GREEDY["max_tokens"] and "".join(pieces) == expected  # a response per token
    assert "stream request failed" not in server.log()


@pytest.fixture()
def oai(server: PierProcess):
    return openai.OpenAI(base_url=f"{server.base()}/v1", api_key="none")


@pytest.mark.frontends  # server-sent events through the HTTP relay
def test_openai_models_and_completions(oai, server: PierProcess) -> None:
    assert [m.id for m in oai.models.list().data] == ["tiny_llama"]
    expected = generate(server, {"text_input": "hello pier", "exclude_input_in_output": True,
                                 "sampling_parameters": json.dumps(GREEDY)})["text_output"]
    c = oai.completions.create(model="tiny_llama", prompt="hello pier", max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True})
    assert c.choices[0].text == expected and c.choices[0].finish_reason == "length"
    assert c.choices[0].model_extra["stop_reason"] is None
    assert c.usage.completion_tokens == 12 and c.usage.prompt_tokens > 0
    # stop_reason names what stopped a sequence (vLLM's field): the stop string, or the stop token id.
    stop = expected.strip()[:2]
    s = oai.completions.create(model="tiny_llama", prompt="hello pier", max_tokens=12, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert s.choices[0].finish_reason == "stop" and s.choices[0].model_extra["stop_reason"] == stop
    chat = oai.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=12, temperature=0, stop=[stop])
    assert "stop_reason" in chat.choices[0].model_extra
    # Chat template options (vLLM's extra fields): no generation prompt -> fewer prompt tokens and the
    # answer keeps the last message's role; contradictory or unsupported options are 400s.
    hi = [{"role": "user", "content": "hi"}]
    plain = oai.chat.completions.create(model="tiny_llama", messages=hi, max_tokens=2, temperature=0)
    bare = oai.chat.completions.create(model="tiny_llama", messages=hi, max_tokens=2, temperature=0,
                                       extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens < plain.usage.prompt_tokens
    assert bare.choices[0].message.role == "user" and plain.choices[0].message.role == "assistant"
    for extra, field in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"chat_template_kwargs": [1]}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError, match=field):
            oai.chat.completions.create(model="tiny_llama", messages=hi, max_tokens=2, extra_body=extra)
    assert c.usage.total_tokens == c.usage.prompt_tokens + 12
    chunks = list(oai.completions.create(model="tiny_llama", prompt="hello pier", max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])
    running = list(oai.completions.create(model="tiny_llama", prompt="hello pier", max_tokens=12, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True},
                                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in running]
    assert counts == sorted(counts) and counts[-1] == 12 and all(ch.usage.prompt_tokens > 0 for ch in running)
    assert counts == [*range(1, 13), 12]  # a chunk per token (text '' while a character is pending), as vLLM
    with pytest.raises(openai.BadRequestError, match="suffix"):
        oai.completions.create(model="tiny_llama", prompt="hello", suffix="!", max_tokens=2)
    lp = oai.completions.create(model="tiny_llama", prompt="hello", max_tokens=4, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True})
    assert len(lp.choices[0].logprobs.token_logprobs) == 4
    assert all(v <= 0 for v in lp.choices[0].logprobs.token_logprobs)
    whole = lp.choices[0].logprobs
    assert all(tok in top for tok, top in zip(whole.tokens, whole.top_logprobs))  # the chosen token too (vLLM)
    streamed = [ch.choices[0].logprobs for ch in oai.completions.create(
        model="tiny_llama", prompt="hello", max_tokens=4, temperature=0, logprobs=2, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs]
    assert [o for part in streamed for o in part.text_offset] == whole.text_offset  # offsets run across chunks
    # echo + logprobs (lm-eval's loglikelihood pattern): the prompt's tokens come first, the very
    # first without a logprob, as vLLM answers; streamed, the prompt chunk carries them.
    ev = oai.completions.create(model="tiny_llama", prompt="hello pier", max_tokens=2, temperature=0, logprobs=1,
                                echo=True, extra_body={"ignore_eos": True})
    elp = ev.choices[0].logprobs
    assert ev.choices[0].text.startswith("hello pier")
    assert len(elp.tokens) == ev.usage.prompt_tokens + 2 == len(elp.token_logprobs) == len(elp.text_offset)
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v <= 0 for v in elp.token_logprobs[1:]) and elp.text_offset == sorted(elp.text_offset)
    parts = [ch.choices[0].logprobs for ch in oai.completions.create(
        model="tiny_llama", prompt="hello pier", max_tokens=2, temperature=0, logprobs=1, echo=True, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs]
    assert [t for part in parts for t in part.tokens] == elp.tokens
    assert [o for part in parts for o in part.text_offset] == elp.text_offset
    ids = oai.completions.create(model="tiny_llama", prompt=[5, 6, 7, 8, 9], max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 4
    n2 = oai.completions.create(model="tiny_llama", prompt="hello", max_tokens=5, n=2, temperature=1.0, seed=7,
                                extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in n2.choices) == [0, 1] and n2.usage.completion_tokens == 10
    biased = oai.completions.create(model="tiny_llama", prompt="hello", max_tokens=4, temperature=0, logprobs=0,
                                    logit_bias={"7": 100}, extra_body={"ignore_eos": True})
    tokens = biased.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1  # token 7, four times
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.completions.create(model="tiny_llama", prompt="hello", max_tokens=2, logit_bias={"99999999": 1})


def test_openai_completions_batch_of_prompts(oai, server: PierProcess) -> None:
    """A list of prompts (strings or token-id lists) is one request per prompt; prompt p's
    sequence i is choice p * n + i, as vLLM numbers them; usage sums over the prompts. `echo`
    puts each prompt before its choices' text (streamed: as the first chunk)."""
    single = {p: oai.completions.create(model="tiny_llama", prompt=p, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True}) for p in ("hello pier", "a b c")}
    batch = oai.completions.create(model="tiny_llama", prompt=["hello pier", "a b c"], max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    by_index = {ch.index: ch.text for ch in batch.choices}
    assert by_index == {0: single["hello pier"].choices[0].text, 1: single["a b c"].choices[0].text}
    assert batch.usage.prompt_tokens == sum(c.usage.prompt_tokens for c in single.values())
    assert batch.usage.completion_tokens == 12
    ids = oai.completions.create(model="tiny_llama", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2, temperature=1.0,
                                 seed=3, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in ids.choices) == [0, 1, 2, 3] and ids.usage.prompt_tokens == 5
    alone = [oai.completions.create(model="tiny_llama", prompt=p, max_tokens=3, n=2, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True}) for p in ([5, 6, 7], [8, 9])]
    expected_texts = {p * 2 + ch.index: ch.text for p, c in enumerate(alone) for ch in c.choices}
    assert {ch.index: ch.text for ch in ids.choices} == expected_texts  # seeded: the same draws as alone
    chunks = list(oai.completions.create(model="tiny_llama", prompt=["hello pier", "a b c"], max_tokens=6,
                                         temperature=0, stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    streamed: dict[int, str] = {}
    for ch in chunks:
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == by_index
    assert chunks[-1].usage.completion_tokens == 12
    echoed = oai.completions.create(model="tiny_llama", prompt=["hello pier", "a b c"], max_tokens=6,
                                    temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert {ch.index: ch.text for ch in echoed.choices} == {0: "hello pier" + by_index[0], 1: "a b c" + by_index[1]}
    chunks = list(oai.completions.create(model="tiny_llama", prompt="a b c", max_tokens=6, temperature=0, echo=True,
                                         stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == "a b c" and "".join(c.choices[0].text for c in chunks) == echoed.choices[1].text
    # A token-id prompt's echo is the model's decoding of it, with or without logprobs, for each choice.
    text_prompt = oai.completions.create(model="tiny_llama", prompt="a b c", max_tokens=3, temperature=0,
                                         logprobs=0, echo=True, extra_body={"ignore_eos": True})
    ids = oai.completions.create(model="tiny_llama", prompt=[[5, 6, 7]], max_tokens=3, temperature=1.0, n=2, seed=3,
                                 echo=True, extra_body={"ignore_eos": True})
    ids_lp = oai.completions.create(model="tiny_llama", prompt=[5, 6, 7], max_tokens=3, temperature=0, logprobs=0,
                                    echo=True, extra_body={"ignore_eos": True})
    prompt_text = "".join(ids_lp.choices[0].logprobs.tokens[:3])
    assert ids_lp.choices[0].text.startswith(prompt_text) and ids_lp.choices[0].logprobs.token_logprobs[0] is None
    assert all(ch.text.startswith(prompt_text) and ch.logprobs is None for ch in ids.choices)
    assert len(ids.choices) == 2 and text_prompt.choices[0].text.startswith("a b c")
    streamed_ids = list(oai.completions.create(model="tiny_llama", prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                               echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert streamed_ids[0].choices[0].text == prompt_text
    aborted = _aborted(server)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):  # one bad prompt fails the call
        oai.completions.create(model="tiny_llama", prompt=["hello", "word " * 600], max_tokens=200,
                               extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError, match="prompt must be"):
        oai.completions.create(model="tiny_llama", prompt=["hello", 3], max_tokens=4)
    deadline = time.monotonic() + 20  # the other prompt's request is cancelled, not left running
    while time.monotonic() < deadline and _metric(server, "vllm:num_requests_running") > 0:
        time.sleep(0.1)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _aborted(server) == aborted + 1  # "hello" was cancelled, not run to its 200 tokens


def test_openai_chat(oai) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    c = oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content
    assert c.usage.completion_tokens == 8
    stream = oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=8, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # top_logprobs: as many as asked, best first, the greedy choice at the top (alternatives whose
    # texts coincide are all there: a list, not an object keyed by text)
    lp = oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=6, temperature=0,
                                     logprobs=True, top_logprobs=20, extra_body={"ignore_eos": True})
    for entry in lp.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])


def test_openai_tokens_as_token_ids(oai) -> None:
    """vLLM's return_tokens_as_token_ids: logprob tokens (and alternatives, and the echoed prompt's)
    are "token_id:N", the ids the model produced; usage and text are unchanged."""
    ids = [5, 6, 7, 8]
    c = oai.completions.create(model="tiny_llama", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True,
                               extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = c.choices[0].logprobs
    assert lp.tokens[:4] == [f"token_id:{i}" for i in ids] and len(lp.tokens) == 7
    assert all(t.startswith("token_id:") for t in lp.tokens)
    assert all(all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs[1:])
    chat = oai.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(e.token.startswith("token_id:") for e in entries)
    assert all(e.token == e.top_logprobs[0].token for e in entries)  # greedy: the best alternative


def test_openai_logprob_tokens_of_multibyte_characters(oai) -> None:
    """A character that spans several byte tokens: its last token carries it, the ones before it
    carry '' (as vLLM), so the tokens spell the text and text_offset stays in step with it."""
    prompt = "café ☕ ok"
    ev = oai.completions.create(model="tiny_llama", prompt=prompt, max_tokens=1, temperature=0, logprobs=0, echo=True)
    tokens = ev.choices[0].logprobs.tokens
    assert not any("\ufffd" in t for t in tokens), tokens
    assert prompt in "".join(tokens), tokens
    assert any(t == "" for t in tokens), tokens  # the test tokenizer splits ☕ into bytes


def test_openai_chat_shapes_clients_send(oai, server: PierProcess) -> None:
    """What the SDK and agent frameworks send, rendered as vLLM renders it: content as text parts,
    null assistant content, the developer role; `n: null`; no `model` (the one served)."""
    def prompt_tokens(messages: list, **extra) -> int:
        return oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=1,
                                           temperature=0, **extra).usage.prompt_tokens

    plain = prompt_tokens([{"role": "user", "content": "hi\nthere"}])
    assert prompt_tokens([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                       {"type": "text", "text": "there"}]}]) == plain
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None},
               {"role": "user", "content": "b"}]
    assert prompt_tokens(history) == prompt_tokens([{**m, "content": m["content"] or ""} for m in history])
    assert prompt_tokens([{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]) == \
        prompt_tokens([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": None, "temperature": 0}
    r = requests.post(f"{server.base()}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "tiny_llama" and len(r.json()["choices"]) == 1, r.text


def test_vllm_probe_endpoints(server: PierProcess) -> None:
    """vLLM's /health, /ping, /version and /metrics on the API port, for probes and scrape jobs."""
    assert requests.get(f"{server.base()}/health", timeout=10).status_code == 200
    assert requests.get(f"{server.base()}/ping", timeout=10).status_code == 200
    assert requests.post(f"{server.base()}/ping", timeout=10).status_code == 200
    assert requests.get(f"{server.base()}/version", timeout=10).json()["version"]
    text = requests.get(f"{server.base()}/metrics", timeout=10).text
    assert "vllm:num_requests_running" in text and "nv_inference_count" in text


def test_tokenize_and_detokenize_as_vllm(server: PierProcess) -> None:
    """vLLM's /tokenize and /detokenize: the ids are the model tokenizer's (special tokens added as
    the engine adds them; a chat rendered by the template), and decode back."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(server.model_dir / "tokenizer.json"))  # type: ignore[attr-defined]
    base = server.base()
    r = requests.post(f"{base}/tokenize", json={"model": "tiny_llama", "prompt": "Héllo wörld ☃"}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("Héllo wörld ☃").ids, body
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0 and body["token_strs"] is None
    r = requests.post(f"{base}/detokenize", json={"model": "tiny_llama", "tokens": body["tokens"]}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"].endswith("Héllo wörld ☃"), r.text
    chat = requests.post(f"{base}/tokenize", timeout=30, json={
        "model": "tiny_llama", "messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = "<user>hi\n<assistant>"  # CHAT_TEMPLATE with a generation prompt
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False).ids, chat
    for path, doc, field in (("tokenize", {"prompt": 5}, "prompt"), ("tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                             ("detokenize", {"tokens": ["a"]}, "tokens"), ("detokenize", {"tokens": [10**9]}, None)):
        r = requests.post(f"{base}/{path}", json={"model": "tiny_llama", **doc}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_llm_embeddings_match_transformers(oai, server: PierProcess) -> None:
    """/v1/embeddings on the LLM: vLLM's embed runner (last token, normalised) on the same weights
    as transformers; the SDK's default (base64) equals the float call; text and token ids."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    folder = server.model_dir  # type: ignore[attr-defined]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = ["The quick brown fox.", "Paged attention keeps blocks."]
    model = transformers.AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [torch.nn.functional.normalize(model(torch.tensor([tok.encode(t).ids])).last_hidden_state[0, -1],
                                             dim=-1).numpy() for t in texts]
    default = oai.embeddings.create(model="tiny_llama", input=texts)
    floats = oai.embeddings.create(model="tiny_llama", input=texts, encoding_format="float")
    got = np.array([d.embedding for d in default.data])
    assert np.array_equal(got, np.array([d.embedding for d in floats.data]))
    assert min(float(np.dot(g, r)) for g, r in zip(got, ref)) > 0.999
    assert default.usage.prompt_tokens == sum(len(tok.encode(t).ids) for t in texts)
    ids = oai.embeddings.create(model="tiny_llama", input=[tok.encode(texts[0]).ids], encoding_format="float")
    assert np.allclose(ids.data[0].embedding, got[0], atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: truncate"):
        oai.embeddings.create(model="tiny_llama", input="x", extra_body={"truncate": 5})


def test_openai_errors(oai, server: PierProcess) -> None:
    with pytest.raises(openai.NotFoundError, match="nope"):
        oai.completions.create(model="nope", prompt="x")
    for messages, where in (([{"role": "user", "content": 5}], "messages[0].content"),
                            ([{"role": "system", "content": "s"}, {"content": "x"}], "messages[1]"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                             "'image_url' part")):
        with pytest.raises(openai.BadRequestError, match=re.escape(where)):  # a 400, not a 500 (no SDK retries)
            oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n=100000 cannot be greater than max_num_seqs"):
        oai.completions.create(model="tiny_llama", prompt="x", max_tokens=1, n=100000, temperature=1.0)
    for extra, field in (({"temperature": 3}, "temperature"), ({"logprobs": 21}, "logprobs"),
                         ({"extra_body": {"min_tokens": 5}}, "min_tokens"),
                         ({"stream_options": {"include_usage": True}}, "stream_options"),
                         ({"stream": True, "stream_options": "yes"}, "stream_options")):
        with pytest.raises(openai.BadRequestError, match=field):
            oai.completions.create(model="tiny_llama", prompt="x", max_tokens=2, **extra)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    top_logprobs=2)
    assert oai.completions.create(model="tiny_llama", prompt="x", max_tokens=3.0,  # type: ignore[arg-type]
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    r = requests.post(f"{server.base()}/v1/completions", timeout=60,  # explicit null: the default 16, as vLLM
                      json={"model": "tiny_llama", "prompt": "x", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model="tiny_llama", prompt="x", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.completions.create(model="tiny_llama", prompt="word " * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens=1000000000 cannot be greater than max_model_len") \
            as too_long:
        oai.completions.create(model="tiny_llama", prompt="x", max_tokens=10**9)
    # /v1/models reports the same context limit the engine enforces (vLLM's model card field).
    limit = int(re.search(r"max_model_len=(\d+)", str(too_long.value)).group(1))
    cards = requests.get(f"{server.base()}/v1/models/", timeout=10).json()["data"]  # trailing slash too
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("tiny_llama", limit)]
    # a prompt that fits but leaves less room than max_tokens: vLLM's 400 (LiteLLM maps the words to
    # ContextWindowExceededError), not a completion cut short
    with pytest.raises(openai.BadRequestError, match=f"you requested {limit + 2} tokens \\({limit - 2} in the"):
        oai.completions.create(model="tiny_llama", prompt=[5] * (limit - 2), max_tokens=4)
    assert oai.completions.create(model="tiny_llama", prompt=[5] * (limit - 4), max_tokens=4,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="response_format.type must be"):
        oai.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    response_format={"type": "yaml"})  # type: ignore[arg-type,typeddict-item]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="needs a tool call parser"):  # auto: this model has none
        oai.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    tools=[tool])
    plain = oai.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                        response_format={"type": "text"}, tools=[tool], tool_choice="none")
    assert plain.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="greedy"):
        oai.completions.create(model="tiny_llama", prompt="x", n=2, temperature=0)
    for body, fragment in (({"prompt": [2**63]}, "token id 9223372036854775808 in prompt is out of range"),
                           ({"prompt": "x", "stream": 5}, "stream must be a boolean"),
                           ({"prompt": "x", "echo": "maybe"}, "echo must be a boolean"),
                           ({"prompt": "x", "n": "two"}, "n must be an integer"),
                           ({"prompt": ["a"] * 5000}, "prompt holds 5000 prompts; at most 1024"),
                           ({"prompt": "x", "model": 5}, "model must be a string, got a number"),
                           ({"prompt": ["x", ""]}, "prompt cannot be empty")):
        r = requests.post(f"{server.base()}/v1/completions", json={"model": "tiny_llama", "max_tokens": 2, **body},
                          timeout=60)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    r = requests.post(f"{server.base()}/v1/completions", timeout=60,  # lax booleans, as vLLM's pydantic reads them
                      json={"model": "tiny_llama", "prompt": "x", "max_tokens": 2, "stream": "false", "echo": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("x"), r.text
    r = requests.post(f"{server.base()}/v1/completions", timeout=60,  # lax ints too: digit strings, bools
                      json={"model": "tiny_llama", "prompt": "x", "max_tokens": "3", "logprobs": True,
                            "temperature": 0, "ignore_eos": True})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert len(choice["logprobs"]["tokens"]) == 3 and len(choice["logprobs"]["top_logprobs"][0]) == 1
    r = requests.post(f"{server.base()}/v1/completions", data=b'{"model":"tiny_llama","prompt":"\\ud800"}',
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "failed to parse" in r.json()["error"]["message"], r.text


def _metric(server: PierProcess, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def _aborted(server: PierProcess) -> float:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line))


# Fields Pier does not implement (OpenAI's, vLLM's extra_body ones, typos): each a 400 naming it,
# never a 200 with the field ignored (issue 23); (endpoint, field, value).
UNIMPLEMENTED_FIELDS = [
    ("completions", "guided_json", {"type": "object"}),
    ("chat", "guided_regex", "a+"),
    ("chat", "guided_choice", ["a", "b"]),
    ("completions", "guided_grammar", "root ::= 'a'"),
    ("chat", "lora_name", "adapter"),
    ("completions", "mm_processor_kwargs", {}),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "audio", {"voice": "alloy"}),
    ("chat", "web_search_options", {}),
    ("completions", "temprature", 0.5),  # a typo is not silently sampled at the default
    ("completions", "best_of", 3),
    ("chat", "store", True),
    ("chat", "service_tier", "flex"),
]


@pytest.mark.parametrize("endpoint,field,value", UNIMPLEMENTED_FIELDS, ids=[f[1] for f in UNIMPLEMENTED_FIELDS])
def test_unimplemented_fields_are_refused_by_name(server: PierProcess, endpoint: str, field: str, value) -> None:
    body = {"model": "tiny_llama", "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"})
    path = "chat/completions" if endpoint == "chat" else "completions"
    r = requests.post(f"{server.base()}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                   "color": {"enum": ["red", "green"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "ok", "color", "count"], "additionalProperties": False,
}


def test_structured_output_json_schema_with_the_sdk(oai) -> None:
    """response_format json_schema (what langchain's with_structured_output and the SDK's .parse()
    send): every choice of every seed validates, streamed or not, on a random-weight model."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": STRUCTURED_SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Describe a thing."}]
    for seed in range(4):
        r = oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=120, n=2, seed=seed,
                                        temperature=1.0, response_format=fmt)  # type: ignore[arg-type]
        for c in r.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), STRUCTURED_SCHEMA)
        stream = oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=120, seed=seed,
                                             temperature=1.0, response_format=fmt, stream=True)  # type: ignore
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        jsonschema.validate(json.loads(text), STRUCTURED_SCHEMA)
    prompt = oai.completions.create(model="tiny_llama", prompt="x", max_tokens=120, seed=1, temperature=1.0,
                                    extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(prompt.choices[0].text), STRUCTURED_SCHEMA)


def test_structured_output_sdk_parse_into_a_pydantic_model(oai) -> None:
    from typing import Literal

    import pydantic

    class Thing(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        color: Literal["red", "green"]
        ok: bool

    parsed = oai.chat.completions.parse(model="tiny_llama", messages=[{"role": "user", "content": "x"}],
                                        max_tokens=60, response_format=Thing, seed=3, temperature=1.0)
    assert isinstance(parsed.choices[0].message.parsed, Thing)


def test_langchain_with_structured_output(server: PierProcess) -> None:
    """langchain-openai's with_structured_output (json_schema by default) gets a parsed object."""
    from typing import Literal

    import pydantic
    from langchain_openai import ChatOpenAI

    class Verdict(pydantic.BaseModel):
        answer: Literal["yes", "no"]
        sure: bool

    chat = ChatOpenAI(model="tiny_llama", base_url=f"{server.base()}/v1", api_key="none", max_tokens=40,
                      temperature=1.0, seed=3)
    result = chat.with_structured_output(Verdict).invoke("Is the sky blue?")
    assert isinstance(result, Verdict)


def test_structured_outputs_choice_regex_and_generate(oai, server: PierProcess) -> None:
    """vLLM's structured_outputs (extra_body), and the same object in Triton generate's
    sampling_parameters; an unsatisfiable schema is a 400 that says so."""
    messages = [{"role": "user", "content": "x"}]
    for seed in range(3):
        r = oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=40, seed=seed,
                                        temperature=1.0, extra_body={"structured_outputs": {"choice": ["up", "down"]}})
        assert r.choices[0].message.content in ("up", "down")
        r = oai.completions.create(model="tiny_llama", prompt="x", max_tokens=40, seed=seed, temperature=1.0,
                                   extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text), r.choices[0].text
    out = generate(server, {"text_input": "x", "sampling_parameters": json.dumps(
        {"max_tokens": 40, "temperature": 1.0, "seed": 2, "structured_outputs": {"choice": ["alpha", "beta"]}})})
    assert out["text_output"] in ("xalpha", "xbeta"), out  # the prompt, then the choice
    bad = {"type": "object", "properties": {"a": {"type": "string", "minLength": 4, "maxLength": 1}},
           "required": ["a"]}
    with pytest.raises(openai.BadRequestError, match="(?i)unsatisfiable"):
        oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="not both"):
        oai.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=8,
                                    response_format={"type": "json_object"},
                                    extra_body={"structured_outputs": {"regex": "a"}})


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 8},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}


def test_named_and_required_tool_calls_parse_and_validate(oai) -> None:
    """tool_choice naming a function or "required": the calls are constrained to the tools'
    parameter schemas, so they parse and validate, whole or streamed; tool and assistant
    tool_calls messages go back through the chat template."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in range(3):
        r = oai.chat.completions.create(model="tiny_llama", messages=messages, tools=[WEATHER, ADD], max_tokens=80,
                                        tool_choice={"type": "function", "function": {"name": "add"}}, seed=seed,
                                        temperature=1.0)  # type: ignore[arg-type]
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and r.choices[0].finish_reason == "stop"  # OpenAI: "stop" when forced
        jsonschema.validate(json.loads(call.function.arguments), schemas["add"])
        r = oai.chat.completions.create(model="tiny_llama", messages=messages, tools=[WEATHER, ADD], max_tokens=200,
                                        tool_choice="required", seed=seed, temperature=1.0)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls, r
        for call in r.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        stream = oai.chat.completions.create(model="tiny_llama", messages=messages, tools=[WEATHER], stream=True,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                             max_tokens=80, seed=seed, temperature=1.0)  # type: ignore[arg-type]
        name, args, ids = None, "", set()
        for chunk in stream:
            for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name = delta_call.function.name or name
                args += delta_call.function.arguments or ""
                ids |= {delta_call.id} - {None}
        assert name == "get_weather" and len(ids) == 1
        jsonschema.validate(json.loads(args), schemas["get_weather"])
        stream = oai.chat.completions.create(model="tiny_llama", messages=messages, tools=[WEATHER, ADD], stream=True,
                                             tool_choice="required", max_tokens=200, seed=seed, temperature=1.0)
        calls, finish = [], None
        for chunk in stream:
            if chunk.choices:
                calls += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        assert calls and finish == "tool_calls"
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    call_id = r.choices[0].message.tool_calls[0].id
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "3"}]
    r = oai.chat.completions.create(model="tiny_llama", messages=history, tools=[ADD], tool_choice="none",
                                    max_tokens=4)  # type: ignore[arg-type]
    assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens >= 1


@pytest.mark.slow
def test_a_model_with_its_own_settings(tmp_path) -> None:
    """A model with `tool_call_parser` answers tool_choice "auto": free text, read by the parser
    (its formats are unit-tested in tests/server/test_openai_tools.py); a name it does not know
    fails the load, naming the choices. Its generation_config.json supplies sampling defaults and
    max_tokens_cap bounds what a request may ask."""
    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path / "repo"
    folder = build_model(repo / "auto_llama" / "1", "llama")
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0, "max_new_tokens": 3}))
    config = ('backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "4000000" } }\n'
              'parameters { key: "tool_call_parser" value { string_value: "%s" } }\n')
    (repo / "auto_llama" / "config.pbtxt").write_text(
        config % "hermes" + 'parameters { key: "max_tokens_cap" value { string_value: "8" } }\n')
    build_model(repo / "bad_parser" / "1", "llama")
    (repo / "bad_parser" / "config.pbtxt").write_text(config % "qwen_magic")
    proc = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false", log_path=tmp_path / "pier.log",
                      timeout=120)
    try:
        client = openai.OpenAI(base_url=f"{proc.base()}/v1", api_key="none")
        r = client.chat.completions.create(model="auto_llama", messages=[{"role": "user", "content": "x"}],
                                           tools=[ADD], max_tokens=6, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content  # no call in random text
        # generation_config.json's defaults (as vLLM's --generation-config auto): greedy, 3 tokens
        plain = [client.chat.completions.create(model="auto_llama", messages=[{"role": "user", "content": "hi"}],
                                                extra_body={"ignore_eos": True}) for _ in range(2)]
        assert [p.usage.completion_tokens for p in plain] == [3, 3]
        assert plain[0].choices[0].message.content == plain[1].choices[0].message.content  # temperature 0
        with pytest.raises(openai.BadRequestError, match=r"max_tokens=20 is more than this model allows"):
            client.chat.completions.create(model="auto_llama", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=20)
        index = requests.post(f"{proc.base()}/v2/repository/index", json={}, timeout=10).json()
        (bad,) = [row for row in index if row["name"] == "bad_parser"]
        assert "tool_call_parser 'qwen_magic' is not one of hermes, llama3_json, mistral" in bad["reason"], bad
    finally:
        assert proc.stop() == 0


def test_compatible_fields_are_accepted(oai) -> None:
    """What asks for nothing beyond the default passes: OpenAI's `user`, default values, nulls."""
    oai.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                user="u-1", store=False, parallel_tool_calls=False, service_tier="auto",
                                extra_body={"priority": 0, "best_of": None, "guided_json": None})
    # priority is read: without scheduling_policy "priority" a non-zero one is vLLM's 400
    with pytest.raises(openai.BadRequestError, match="Got priority 5 but Priority scheduling is not enabled"):
        oai.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    extra_body={"priority": 5})


@pytest.mark.frontends  # a client leaving closes the relay's upstream
def test_disconnect_mid_stream_frees_blocks(server: PierProcess) -> None:
    generated_before, aborted_before = _metric(server, "vllm:generation_tokens_total"), _aborted(server)
    body = json.dumps({"model": "tiny_llama", "prompt": "a long story", "max_tokens": 400, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    sock.settimeout(30)
    while b"data: " not in received:  # streaming has started
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert _metric(server, "vllm:num_requests_running") == 1
    sock.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_metric(server, "vllm:num_requests_running") > 0
                                           or _metric(server, "vllm:kv_cache_usage_perc") > 0):
        time.sleep(0.1)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0
    assert _metric(server, "vllm:generation_tokens_total") - generated_before < 400  # it stopped early
    assert _aborted(server) == aborted_before + 1
    assert _metric(server, "vllm:time_to_first_token_seconds_count") >= 1
    assert "Cannot write to closing transport" not in server.log()  # a client leaving is not an error


@pytest.mark.frontends  # likewise for a plain request
def test_disconnect_cancels_a_non_streaming_request(server: PierProcess) -> None:
    """A client that gives up on a whole (non-streamed) answer cancels the request too."""
    aborted_before = _aborted(server)
    generated_before = _metric(server, "vllm:generation_tokens_total")
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{server.base()}/v1/completions", timeout=(5, 0.3),
                      json={"model": "tiny_llama", "prompt": "a long story", "max_tokens": 400, "n": 32,
                            "temperature": 1.0, "ignore_eos": True})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_aborted(server) < aborted_before + 1
                                           or _metric(server, "vllm:num_requests_running") > 0):
        time.sleep(0.1)
    assert _aborted(server) == aborted_before + 1
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:generation_tokens_total") - generated_before < 32 * 400  # it stopped early


@pytest.mark.frontends  # the gRPC relay carries the deadline
def test_grpc_stream_deadline_cancels_the_request(server: PierProcess) -> None:
    """A stream whose gRPC deadline passes (tritonclient's stream_timeout) ends with
    DEADLINE_EXCEEDED, and the request it was generating is aborted and its blocks freed."""
    aborted_before = _aborted(server)
    generated_before = _metric(server, "vllm:generation_tokens_total")
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers),
                        stream_timeout=1.5)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a long story"], dtype=object))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps(
        {"temperature": 1.0, "max_tokens": 400, "n": 32, "ignore_eos": True}).encode()], dtype=object))
    client.async_stream_infer("tiny_llama", [text, stream, sampling], request_id="slow")
    error = None
    while error is None:
        _, error = answers.get(timeout=60)
    assert "DEADLINE_EXCEEDED" in str(error) or "Deadline" in str(error), error
    client.stop_stream()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_aborted(server) < aborted_before + 1
                                           or _metric(server, "vllm:num_requests_running") > 0
                                           or _metric(server, "vllm:kv_cache_usage_perc") > 0):
        time.sleep(0.1)
    assert _aborted(server) == aborted_before + 1
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0
    assert _metric(server, "vllm:generation_tokens_total") - generated_before < 32 * 400  # it stopped early


def test_a_streamed_generation_is_traced(server: PierProcess) -> None:
    """A decoupled model's request traces one INFER_RESPONSE_COMPLETE per streamed response."""
    setting = f"{server.base()}/v2/models/tiny_llama/trace/setting"
    r = requests.post(setting, json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1",
                                     "log_frequency": "1"}, timeout=10)
    assert r.status_code == 200, r.text
    try:
        body = {"text_input": "trace me", "sampling_parameters": json.dumps({**GREEDY, "max_tokens": 4}),
                "stream": True}
        r = requests.post(f"{server.base()}/v2/models/tiny_llama/generate_stream", json=body, timeout=60)
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and len(events) >= 2, r.text
        path = Path(f"{server.trace_file}.0")
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        records = json.loads(path.read_text())
        names = [rec["timestamps"][0]["name"] for rec in records if "timestamps" in rec]
        assert names[:2] == ["REQUEST_START", "QUEUE_START"] and names[-1] == "REQUEST_END", names
        assert names.count("INFER_RESPONSE_COMPLETE") >= len(events), (names, events)
        assert next(rec for rec in records if "model_name" in rec)["model_name"] == "tiny_llama"
    finally:
        requests.post(setting, json={"trace_level": None, "trace_rate": None, "trace_count": None,
                                     "log_frequency": None}, timeout=10)


def test_llm_metrics_are_exported(server: PierProcess) -> None:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    for name in ("vllm:num_requests_waiting", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:inter_token_latency_seconds_count"):
        assert f'{name}{{model_name="tiny_llama"' in text, name
    # vLLM's info gauge of the KV cache settings (gateways read num_gpu_blocks x block_size)
    (line,) = [x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")]
    info = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert line.endswith("} 1.0") and info["model_name"] == "tiny_llama" and info["engine"] == "0", line
    assert (info["block_size"], info["kv_cache_memory_bytes"], info["enable_prefix_caching"]) == ("16", "8000000",
                                                                                                   "True"), info
    assert int(info["num_gpu_blocks"]) > 0
    assert int(info["kv_cache_size_tokens"]) == int(info["num_gpu_blocks"]) * 16


def test_request_level_histograms(server: PierProcess) -> None:
    """vLLM's per-request histograms (Grafana's vLLM dashboard reads them): one finished request of
    5 generated tokens adds one observation to each, with the right token counts."""
    def metric(name: str) -> float:
        return _metric(server, name)

    names = ("vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_count",
             "vllm:request_params_max_tokens_sum", "vllm:request_params_n_count",
             "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
             "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
             "vllm:request_time_per_output_token_seconds_count", "vllm:request_prompt_tokens_count")
    before = {n: metric(n) for n in names}
    generate(server, {"text_input": "count me", "sampling_parameters": json.dumps({**GREEDY, "max_tokens": 5})})
    delta = {n: metric(n) - before[n] for n in names}
    assert delta["vllm:request_generation_tokens_sum"] == 5 and delta["vllm:request_params_max_tokens_sum"] == 5
    assert all(v == 1 for n, v in delta.items() if n.endswith("_count")), delta
