"""Multi-LoRA on a real `pier serve` (issue 34, part 1): adapters from `lora_modules` (a path
relative to the model's folder) and Triton's multi_lora.json, picked by the OpenAI `model` field;
greedy answers equal PEFT's PeftModel + transformers token for token, base and two adapters sent at
once; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter with its codes and texts; /v1/models
lists the adapters with root and parent, and so does the repository index; a corrupt adapter fails
its load, named, and the server keeps serving; vllm:lora_requests_info as vLLM exports it; Triton's
`lora_name` on generate; what the load and unload routes changed outlives a `kill -9` of the engine
process."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import start_pier
from tests.processes import alive, descendants

pytestmark = pytest.mark.llm

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

N = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from tests.backends.llm.tiny_model import build_adapter, build_model, peft_greedy

    root = tmp_path_factory.mktemp("lora")
    repo = root / "repo"
    base = build_model(repo / "base" / "1", "llama")
    adapters = {"a1": build_adapter(base, repo / "base" / "adapters" / "a1", 1, r=8, alpha=16),
                "a2": build_adapter(base, root / "a2", 2, r=4, alpha=8, use_rslora=True,
                                    targets=("q_proj", "v_proj", "down_proj"))}
    (base / "multi_lora.json").write_text(json.dumps({"a2": "../../../a2"}))  # Triton's form: from the version folder
    params = {"enable_lora": "true", "max_loras": "2", "kv_cache_memory_bytes": str(4 << 20),
              "lora_modules": json.dumps([{"name": "a1", "path": "adapters/a1"}])}
    (repo / "base" / "config.pbtxt").write_text('backend: "llm"\n' + "".join(
        f'parameters {{ key: "{k}" value {{ string_value: {json.dumps(v)} }} }}\n' for k, v in params.items()))
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (4, 21)]
    refs = {name: peft_greedy(base, path, prompts, N) for name, path in {None: None, **adapters}.items()}
    proc = start_pier([repo], log_path=root / "pier.log", timeout=120)
    yield proc, prompts, refs, adapters, root
    assert proc.stop() == 0, proc.log()


def _ids(oai, model: str | None, prompt: list[int]) -> list[int]:
    c = oai.completions.create(model=model or "base", prompt=prompt, max_tokens=N, temperature=0, logprobs=0,
                               extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert c.model == (model or "base")
    return [int(t.split(":")[1]) for t in c.choices[0].logprobs.tokens]


def check_at_once(base: str, prompts: list[list[int]], refs: dict[str | None, list[list[int]]]) -> None:
    """Every prompt through the base model and adapters a1 and a2, all at once (the openai SDK): each
    answer's token ids are PEFT's (`refs`), and the adapters change them."""
    oai = openai.OpenAI(base_url=base + "/v1", api_key="x")
    jobs = [(m, i) for i in range(len(prompts)) for m in (None, "a1", "a2")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _ids(oai, j[0], prompts[j[1]]), jobs))
    assert got == [refs[m][i] for m, i in jobs]
    assert refs["a1"] != refs[None] and refs["a2"] != refs[None]


def test_greedy_equals_peft_base_and_adapters_at_once(setup) -> None:
    server, prompts, refs, _, _ = setup
    check_at_once(server.base(), prompts, refs)


def test_models_list_adapters(setup) -> None:
    server, _, _, adapters, _ = setup
    cards = {c["id"]: c for c in requests.get(server.base() + "/v1/models", timeout=10).json()["data"]}
    assert cards["base"]["parent"] is None and "max_model_len" in cards["base"]
    for name, path in adapters.items():
        assert cards[name]["parent"] == "base" and Path(cards[name]["root"]).resolve() == path.resolve()
        assert cards[name]["max_model_len"] is None  # as vLLM 0.32 (bench/results/lora_endpoints_vllm.md)


def test_the_index_lists_the_adapters(setup) -> None:
    """A row per adapter served beside the base, under the base's version, READY, naming the base."""
    server, _, _, adapters, _ = setup
    for ready in (False, True):
        rows = requests.post(server.base() + "/v2/repository/index", json={"ready": ready}, timeout=10).json()
        assert {"name": "base", "version": "1", "state": "READY"} in rows
        for name, path in adapters.items():
            row = next(r for r in rows if r["name"] == name)
            head = "LoRA adapter of 'base' ("
            assert {**row, "reason": ""} == {"name": name, "version": "1", "state": "READY", "reason": ""}, row
            assert row["reason"].startswith(head) and Path(row["reason"][len(head):-1]).resolve() == path.resolve()


def test_load_and_unload_answer_as_vllm(setup, tmp_path: Path) -> None:
    server, prompts, refs, adapters, _ = setup
    load, unload = server.base() + "/v1/load_lora_adapter", server.base() + "/v1/unload_lora_adapter"
    oai = openai.OpenAI(base_url=server.base() + "/v1", api_key="x")

    def post(url: str, body: dict) -> tuple[int, str]:
        r = requests.post(url, json=body, timeout=30)
        return r.status_code, r.text if r.status_code == 200 else r.json()["error"]["message"]

    assert post(load, {"lora_name": "a3", "lora_path": str(adapters["a1"])}) == (
        200, "Success: LoRA adapter 'a3' added successfully.")
    assert _ids(oai, "a3", prompts[1]) == refs["a1"][1]
    assert post(load, {"lora_name": "a3", "lora_path": str(adapters["a1"])}) == (
        400, "The lora adapter 'a3' has already been loaded. If you want to load the adapter in place, set "
             "'load_inplace' to True.")
    # the same name, new weights: served at once, and never from the old adapter's cached blocks
    assert post(load, {"lora_name": "a3", "lora_path": str(adapters["a2"]), "load_inplace": True})[0] == 200
    assert _ids(oai, "a3", prompts[1]) == refs["a2"][1]
    assert post(load, {"lora_name": "a4"}) == (400, "Both 'lora_name' and 'lora_path' must be provided.")
    assert post(load, {"lora_name": "a4", "lora_path": str(tmp_path)}) == (
        404, f"Loading lora a4 failed: No adapter found for {tmp_path}")
    big = shutil.copytree(adapters["a1"], tmp_path / "big")
    doc = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**doc, "r": 64}))
    assert post(load, {"lora_name": "a4", "lora_path": str(big)}) == (
        400, "LoRA rank 64 is greater than max_lora_rank 16.")
    corrupt = shutil.copytree(adapters["a1"], tmp_path / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    status, text = post(load, {"lora_name": "a4", "lora_path": str(corrupt)})
    assert status == 400 and text.startswith(f"{weights}: not a readable safetensors file")
    assert post(unload, {}) == (400, "'lora_name' needs to be provided to unload a LoRA adapter.")
    assert post(unload, {"lora_name": "a4"}) == (404, "The lora adapter 'a4' cannot be found.")
    assert post(unload, {"lora_name": "a3"}) == (200, "Success: LoRA adapter 'a3' removed successfully.")
    with pytest.raises(openai.NotFoundError, match="The model `a3` does not exist"):
        _ids(oai, "a3", prompts[0])
    assert _ids(oai, None, prompts[0]) == refs[None][0]  # everything else still served


def test_triton_lora_name_and_the_metric(setup) -> None:
    server, _, _, _, _ = setup
    body = {"text_input": "hello pier", "sampling_parameters": json.dumps({"max_tokens": 6, "temperature": 0})}
    url = server.base() + "/v2/models/base/generate"
    texts = {name: requests.post(url, json={**body, "lora_name": name} if name else body, timeout=30).json()
             for name in (None, "a2")}
    assert texts["a2"]["text_output"] != texts[None]["text_output"]
    inside = {**body, "sampling_parameters": json.dumps({"max_tokens": 6, "temperature": 0, "lora_name": "a2"})}
    assert requests.post(url, json=inside, timeout=30).json()["text_output"] == texts["a2"]["text_output"]
    bad = requests.post(url, json={**body, "lora_name": "nope"}, timeout=30)
    assert bad.status_code == 400 and "LoRA nope is not supported, we currently support ['a1', 'a2']" in bad.text
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    row = next(x for x in metrics.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert row.startswith('vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} ')
    assert "# HELP vllm:lora_requests_info Running stats on lora requests." in metrics


def test_lora_routes_are_model_control() -> None:
    from pier.frontends.http.middleware import http_category

    assert http_category("/v1/load_lora_adapter") == http_category("/v1/unload_lora_adapter") == "model-repository"


def test_runtime_loads_and_unloads_outlive_an_engine_restart(setup) -> None:
    """A restarted engine core starts with the startup set of adapters; Pier applies the loads and
    unloads made through the routes since then again before the model is READY, so the server
    serves what it served before the crash."""
    server, prompts, refs, adapters, _ = setup
    load, unload = server.base() + "/v1/load_lora_adapter", server.base() + "/v1/unload_lora_adapter"
    oai = openai.OpenAI(base_url=server.base() + "/v1", api_key="x")

    def engines() -> set[int]:
        return {p for p in alive(descendants(server.proc.pid))
                if b"pier.backends.llm.engine_core" in Path(f"/proc/{p}/cmdline").read_bytes()}

    def served() -> set[str]:
        return {c["id"] for c in requests.get(server.base() + "/v1/models", timeout=10).json()["data"]}

    r = requests.post(load, json={"lora_name": "a5", "lora_path": str(adapters["a1"])}, timeout=30)
    assert r.status_code == 200, r.text
    assert requests.post(unload, json={"lora_name": "a2"}, timeout=30).status_code == 200  # a startup adapter
    try:
        before = served()
        assert "a5" in before and "a2" not in before
        (first,) = engines()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 90
        seen_down = False
        while True:  # down, then back by itself: READY only with the adapters as they were
            ready = requests.get(server.base() + "/v2/models/base/ready", timeout=10).status_code == 200
            seen_down |= not ready
            if seen_down and ready:
                break
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.02)
        assert first not in engines() and len(engines()) == 1
        assert served() == before
        assert _ids(oai, "a5", prompts[1]) == refs["a1"][1]
        with pytest.raises(openai.NotFoundError, match="The model `a2` does not exist"):
            _ids(oai, "a2", prompts[0])
        assert _ids(oai, "a1", prompts[0]) == refs["a1"][0] and _ids(oai, None, prompts[0]) == refs[None][0]
        assert "could not be" not in server.log()
    finally:  # as the other tests expect it
        requests.post(unload, json={"lora_name": "a5"}, timeout=30)
        requests.post(load, json={"lora_name": "a2", "lora_path": str(adapters["a2"])}, timeout=30)
