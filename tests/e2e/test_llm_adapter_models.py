"""Adapters as versioned repository models on a real `pier serve` (issue 34, part 1): a model folder
whose config.pbtxt names a `base_model`, with a PEFT adapter in each version folder. Loading it in
explicit mode loads its base; it answers by its own name on every endpoint, greedy equal to PEFT's
PeftModel + transformers for each version; it rolls 1 -> 2 by weights (the split seen in the
answers) and back in one call; the base unloaded makes it UNAVAILABLE naming the base, and it
serves again once the base is back; bad adapter models fail their own load, named."""

from __future__ import annotations

import json
import queue
import random
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.conftest import PierProcess, start_pier

pytestmark = pytest.mark.llm

pytest.importorskip("peft")
openai = pytest.importorskip("openai")
grpcclient = pytest.importorskip("tritonclient.grpc")

N = 8
KV = 'parameters { key: "kv_cache_memory_bytes" value { string_value: "4000000" } }\n'


def _config(base: str) -> str:
    return f'backend: "llm"\nparameters {{ key: "base_model" value {{ string_value: "{base}" }} }}\n'


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from tests.backends.llm.tiny_model import build_adapter, build_model, peft_greedy

    root = tmp_path_factory.mktemp("adapter_models")
    repo = root / "repo"
    base = build_model(repo / "base" / "1", "llama")
    (repo / "base" / "config.pbtxt").write_text(
        'backend: "llm"\n' + KV + 'parameters { key: "enable_lora" value { string_value: "true" } }\n'
        'parameters { key: "max_loras" value { string_value: "2" } }\n')
    shutil.copytree(base, repo / "plain" / "1")  # an LLM without enable_lora
    (repo / "plain" / "config.pbtxt").write_text(
        'backend: "llm"\n' + KV + 'parameters { key: "engine_core" value { string_value: "thread" } }\n')
    versions = {1: build_adapter(base, repo / "ad" / "1", 1, r=8, alpha=16),
                2: build_adapter(base, root / "staged" / "2", 2, r=4, alpha=8, use_rslora=True,
                                 targets=("q_proj", "v_proj", "down_proj"))}  # copied in by the rollout test
    (repo / "ad" / "config.pbtxt").write_text(_config("base"))
    for name, base_name in (("nobase", "nothere"), ("nolora", "plain"), ("nopeft", "base"), ("overrank", "base")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(_config(base_name))
    (repo / "nopeft" / "1" / "README").write_text("no adapter here")
    build_adapter(base, repo / "overrank" / "1", 3, r=32, alpha=32)
    shutil.copytree(repo / "ad" / "1", repo / "nolora" / "1", dirs_exist_ok=True)
    shutil.rmtree(repo / "nobase" / "1")
    shutil.copytree(repo / "ad" / "1", repo / "nobase" / "1")
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (5, 17)]
    refs = {v: peft_greedy(base, path, prompts, N) for v, path in versions.items()}
    refs[0] = peft_greedy(base, None, prompts, N)
    proc = start_pier([repo], "--model-control-mode=explicit", log_path=root / "pier.log", timeout=120)
    yield proc, repo, versions, prompts, refs
    assert proc.stop() == 0, proc.log()


def _post(server: PierProcess, path: str, body: dict | None = None) -> requests.Response:
    return requests.post(f"{server.base()}/v2/repository{path}", json=body or {}, timeout=300)


def _ids(server: PierProcess, model: str, prompt: list[int]) -> list[int]:
    oai = openai.OpenAI(base_url=server.base() + "/v1", api_key="x")
    c = oai.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0, logprobs=0,
                               extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert c.model == model
    return [int(t.split(":")[1]) for t in c.choices[0].logprobs.tokens]


def _index(server: PierProcess) -> dict[tuple[str, str], dict]:
    rows = _post(server, "/index").json()
    return {(r["name"], r.get("version", "")): r for r in rows}


def _until(check, timeout: float = 30):
    """`check()` once it is truthy (health and retirement reach the index asynchronously)."""
    deadline = time.monotonic() + timeout
    while not (got := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def _grpc_text(server: PierProcess, model: str, text: str, sampling: dict) -> str:
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), results))
    inputs = []
    for name, value in (("text_input", text.encode()), ("sampling_parameters", json.dumps(sampling).encode())):
        t = grpcclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value], dtype=object))
        inputs.append(t)
    flag = grpcclient.InferInput("exclude_input_in_output", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    client.async_stream_infer(model, [*inputs, flag])
    got = results.get(timeout=60)
    client.stop_stream()
    client.close()
    assert not isinstance(got, Exception), got
    return got.as_numpy("text_output")[0].decode()


def test_load_brings_the_base_and_answers_by_its_own_name(setup) -> None:
    server, _, versions, prompts, refs = setup
    loaded = _post(server, "/models/ad/load")
    assert loaded.status_code == 200, loaded.text
    index = _index(server)
    assert index[("base", "1")]["state"] == "READY" and index[("ad", "1")]["state"] == "READY"
    assert [_ids(server, "ad", p) for p in prompts] == refs[1]
    assert [_ids(server, "base", p) for p in prompts] == refs[0]  # the base's own rows keep the base's output
    assert refs[1] != refs[0]
    # every endpoint reaches it by its name: OpenAI, generate, generate_stream, gRPC stream
    sampling = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
    oai = openai.OpenAI(base_url=server.base() + "/v1", api_key="x")
    want = oai.completions.create(model="ad", prompt="hello pier", max_tokens=N, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    body = {"text_input": "hello pier", "exclude_input_in_output": True, "sampling_parameters": json.dumps(sampling)}
    assert requests.post(f"{server.base()}/v2/models/ad/generate", json=body, timeout=60).json()["text_output"] == want
    stream = requests.post(f"{server.base()}/v2/models/ad/generate_stream", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(x[len("data: "):]) for x in stream.text.splitlines() if x.startswith("data: ")]
    assert "".join(c["text_output"] for c in chunks) == want
    assert _grpc_text(server, "ad", "hello pier", sampling) == want
    cards = {c["id"]: c for c in requests.get(server.base() + "/v1/models", timeout=10).json()["data"]}
    assert cards["ad"]["parent"] == "base" and Path(cards["ad"]["root"]).resolve() == versions[1].resolve()
    assert cards["ad"]["max_model_len"] is None  # as vLLM lists an adapter
    assert not any(k.startswith("pier-adapter-model:") for k in cards), cards  # the internal name stays inside
    assert not any(n.startswith("pier-adapter-model:") for n, _ in _index(server))


def test_rollout_1_to_2_by_weights_and_one_call_rollback(setup) -> None:
    server, repo, versions, prompts, refs = setup
    assert _post(server, "/models/ad/rollout", {"weights": {"1": 100}}).status_code == 200
    shutil.copytree(versions[2], repo / "ad" / "2")
    assert _post(server, "/models/ad/versions/2/load").status_code == 200
    assert [_ids(server, "ad", p) for p in prompts] == refs[1]  # v2 READY, but no traffic yet
    split = _post(server, "/models/ad/rollout", {"weights": {"1": 50, "2": 50}})
    assert split.json()["traffic"] == {"1": 50.0, "2": 50.0}, split.text
    index = _index(server)
    assert index[("ad", "1")]["reason"] == index[("ad", "2")]["reason"] == "traffic 50%"
    answers = [tuple(_ids(server, "ad", prompts[0])) for _ in range(16)]
    assert set(answers) == {tuple(refs[1][0]), tuple(refs[2][0])}, answers  # each from one version, both seen
    assert _post(server, "/models/ad/rollout", {"version": "2"}).status_code == 200
    assert [_ids(server, "ad", p) for p in prompts] == refs[2]
    back = _post(server, "/models/ad/rollback")
    assert back.json()["traffic"] == {"1": 100.0}, back.text
    assert [_ids(server, "ad", p) for p in prompts] * 2 == refs[1] * 2
    assert [_ids(server, "base", p) for p in prompts] == refs[0]


@pytest.mark.parametrize(("model", "message"), [
    ("nobase", "failed to load 'nobase': base model 'nothere' failed to load: failed to load 'nothere': model not "
               "found in any model repository"),
    ("nolora", "adapter model 'nolora' version 1: base model 'plain' does not serve LoRA adapters (set its parameter "
               "enable_lora to true)"),
    ("nopeft", "adapter model 'nopeft' version 1: no PEFT adapter in {repo}/nopeft/1 (missing adapter_config.json and "
               "adapter_model.safetensors)"),
    ("overrank", "adapter model 'overrank' version 1: LoRA rank 32 is greater than max_lora_rank 16."),
])
def test_a_bad_adapter_model_fails_its_own_load(setup, model: str, message: str) -> None:
    server, repo, _, prompts, refs = setup
    r = _post(server, f"/models/{model}/load")
    assert r.status_code == 400 and message.format(repo=repo) in r.json()["error"], r.text
    assert [r["state"] for (name, _), r in _index(server).items() if name == model] == ["UNAVAILABLE"]
    assert _ids(server, "base", prompts[0]) == refs[0][0]  # the others keep serving
    assert _ids(server, "ad", prompts[0]) == refs[1][0]


def test_the_base_unloaded_makes_it_unavailable_and_back_it_comes(setup) -> None:
    server, _, _, prompts, refs = setup
    assert _post(server, "/models/base/unload").status_code == 200
    gone = {"state": "UNAVAILABLE", "reason": "base model 'base' is not available: unloaded"}
    for v in ("1", "2"):
        row = _until(lambda v=v: (r := _index(server)[("ad", v)])["state"] == "UNAVAILABLE" and r)
        assert row == {"name": "ad", "version": v, **gone}, row
    r = requests.post(f"{server.base()}/v1/completions", json={"model": "ad", "prompt": [5, 6], "max_tokens": 2},
                      timeout=30)
    assert r.status_code in (400, 404, 503), r.text
    assert _post(server, "/models/base/load").status_code == 200
    assert _until(lambda: _index(server)[("ad", "1")]["state"] == "READY")
    assert _until(lambda: _index(server)[("ad", "2")]["state"] == "READY")
    # as for any model whose weighted versions all stopped serving, the weights went: the newest READY version
    traffic = requests.get(f"{server.base()}/v2/repository/models/ad/traffic", timeout=10).json()["traffic"]
    assert traffic == {"2": 100.0}
    assert [_ids(server, "ad", p) for p in prompts] == refs[2]
    assert _post(server, "/models/ad/rollback").json()["traffic"] == {"1": 100.0}
    assert [_ids(server, "ad", p) for p in prompts] == refs[1]
