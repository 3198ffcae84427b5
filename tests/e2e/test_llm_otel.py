"""The OpenAI API in OpenTelemetry trace mode: a chat or completions call is one `llm_request`
span (vLLM's) under the caller's traceparent, with the GenAI semantic conventions' current
attribute names and vLLM's older ones, the client-side and engine timings, and each prompt's
request as a child (the model span). Also what a gateway reads on these routes: X-Request-Id as
the answer's id, ORCA's load report with the KV cache's use."""

from __future__ import annotations

import json
import time

import pytest
import requests

from tests.conftest import start_pier
from tests.otlp_receiver import OtlpReceiver, tree

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver):
    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path_factory.mktemp("llm_otel") / "repo"
    folder = build_model(repo / "tiny_llama" / "1", "llama")
    cfg = json.loads((folder / "tokenizer_config.json").read_text()) if (folder / "tokenizer_config.json").exists() \
        else {}
    cfg["chat_template"] = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (repo / "tiny_llama" / "config.pbtxt").write_text(
        'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "8000000" } }\n')
    proc = start_pier([repo], "--trace-config=mode=opentelemetry", f"--trace-config=opentelemetry,url={receiver.url}",
                      "--trace-config=rate=1", "--trace-config=level=TIMESTAMPS",
                      "--trace-config=opentelemetry,bsp_schedule_delay=50", log_path=repo.parent / "pier.log",
                      timeout=120)
    yield proc
    assert proc.stop() == 0, proc.log()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base() + "/v1", api_key="none")


def test_chat_call_is_an_llm_request_span(server, receiver) -> None:
    receiver.clear()
    answer = _client(server).with_raw_response.chat.completions.create(
        model="tiny_llama", messages=[{"role": "user", "content": "hi there"}], max_tokens=6, temperature=0,
        top_p=0.9, seed=7, extra_body={"ignore_eos": True},
        extra_headers={"traceparent": TRACEPARENT, "X-Request-Id": "gw-chat-1"})
    assert answer.headers["X-Request-Id"] == "gw-chat-1"
    chat = answer.parse()
    assert chat.id == "chatcmpl-gw-chat-1"  # vLLM's: the gateway's id names the answer
    spans = receiver.trace(TRACE_ID, 3)
    assert tree(spans) == {"llm_request": ["tiny_llama"], "tiny_llama": ["compute"]}
    root = next(s for s in spans if s["name"] == "llm_request")
    assert root["parentSpanId"] == PARENT and root["kind"] == 2
    a = root["attributes"]
    usage = chat.usage
    expected = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny_llama",
                "gen_ai.response.model": "tiny_llama", "gen_ai.response.id": "chatcmpl-gw-chat-1",
                "gen_ai.request.id": "gw-chat-1", "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 0.9,
                "gen_ai.request.max_tokens": 6, "gen_ai.request.seed": 7, "gen_ai.request.n": 1,
                "gen_ai.request.stream": False,
                "gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": 6,
                "gen_ai.usage.prompt_tokens": usage.prompt_tokens, "gen_ai.usage.completion_tokens": 6,
                "gen_ai.usage.num_sequences": 1, "gen_ai.response.finish_reasons": ["length"]}
    assert {k: a.get(k) for k in expected} == expected
    assert usage.completion_tokens == 6 and usage.prompt_tokens > 0
    for name in ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill", "time_in_model_decode",
                 "time_in_model_inference"):
        assert isinstance(a[f"gen_ai.latency.{name}"], float) and a[f"gen_ai.latency.{name}"] >= 0, name
    assert a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert "gen_ai.response.time_to_first_chunk" not in a  # not streamed
    model = next(s for s in spans if s["name"] == "tiny_llama")
    assert model["attributes"]["triton.request_id"] == "gw-chat-1"
    assert [e["name"] for e in model["events"]] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]


def test_streamed_completion_span(server, receiver) -> None:
    receiver.clear()
    chunks = list(_client(server).completions.create(
        model="tiny_llama", prompt="once upon", max_tokens=4, temperature=1.0, seed=1, stream=True, n=2,
        extra_body={"ignore_eos": True}, extra_headers={"traceparent": TRACEPARENT}))
    assert chunks
    root = next(s for s in receiver.trace(TRACE_ID, 3) if s["name"] == "llm_request")
    a = root["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.stream"] is True
    assert a["gen_ai.request.choice.count"] == 2 and a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ["length", "length"]
    assert 0 < a["gen_ai.response.time_to_first_chunk"] == a["gen_ai.latency.time_to_first_token"]


def test_orca_load_report_on_chat(server) -> None:
    body = {"model": "tiny_llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = server.base() + "/v1/chat/completions"
    plain = requests.post(url, json=body, timeout=60)
    assert plain.status_code == 200 and "endpoint-load-metrics" not in plain.headers
    text = requests.post(url, json=body, headers={"endpoint-load-metrics-format": "text"}, timeout=60)
    header = text.headers["endpoint-load-metrics"]
    assert header.startswith("TEXT named_metrics.")
    metrics = dict(part.split("=") for part in header[5:].split(", "))
    assert set(metrics) == {"named_metrics.kv_cache_usage_perc", "named_metrics.num_requests_waiting"}
    assert 0.0 <= float(metrics["named_metrics.kv_cache_usage_perc"]) <= 1.0
    as_json = requests.post(url, json=body, headers={"endpoint-load-metrics-format": "json"}, timeout=60)
    report = json.loads(as_json.headers["endpoint-load-metrics"][5:])["named_metrics"]
    assert set(report) == {"kv_cache_usage_perc", "num_requests_waiting"}


def test_reset_prefix_cache_over_http(server) -> None:
    """vLLM's POST /reset_prefix_cache through the engine process: 409 while a request holds KV
    blocks, 200 once idle. The stream's first chunk can leave before the engine has the request,
    so the busy reset waits for two tokens' chunks (prefill done: its blocks are held); the 448
    tokens left outlast the reset's round trip many times over."""
    url = server.base() + "/reset_prefix_cache"
    body = {"model": "tiny_llama", "prompt": "a b c d e f g h", "max_tokens": 450, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with requests.post(server.base() + "/v1/completions", json=body, stream=True, timeout=60) as streaming:
        chunks = (line for line in streaming.iter_lines() if line.startswith(b"data: {"))
        for _ in range(3):
            next(chunks)
        busy = requests.post(url, timeout=30)
    assert busy.status_code == 409 and "Prefix cache reset failed" in busy.json()["error"]
    for _ in range(100):  # the aborted request lets its blocks go
        idle = requests.post(url, timeout=30)
        if idle.status_code == 200:
            break
        time.sleep(0.1)
    assert idle.status_code == 200 and idle.content == b""
