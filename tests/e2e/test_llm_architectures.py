"""Each architecture beyond Llama, served by `pier serve` from one model repository, answers the OpenAI
API with transformers' greedy tokens (32, on prompts longer than its sliding window) and prompt
logprobs within 2e-3; a checkpoint of an unknown architecture, or one missing a tensor, fails its own
load with a message naming the cause while the others serve."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import requests

from tests.backends.llm.tiny_model import ARCHITECTURES as MODELS
from tests.conftest import PierProcess, start_pier

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

CONFIG = 'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "4000000" } }\n'


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from safetensors.torch import load_file, save_file

    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path_factory.mktemp("archs") / "repo"
    folders = {}
    for i, (name, (arch, settings)) in enumerate(MODELS.items()):
        folders[name] = build_model(repo / name / "1", arch, seed=30 + i, **settings)
        (repo / name / "config.pbtxt").write_text(CONFIG)
    unknown = build_model(repo / "unknown_arch" / "1", "llama")
    raw = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**raw, "architectures": ["FalconForCausalLM"]}))
    missing = build_model(repo / "missing_tensor" / "1", "qwen3")
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, missing / "model.safetensors")
    for name in ("unknown_arch", "missing_tensor"):
        (repo / name / "config.pbtxt").write_text(CONFIG)
    proc = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false",
                      log_path=repo.parent / "pier.log", timeout=300)
    yield proc, folders
    assert proc.stop() == 0, proc.log()


@pytest.mark.llm
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_and_prompt_logprobs_equal_transformers(served: tuple[PierProcess, dict[str, Path]], name: str) -> None:
    import transformers

    from tests.backends.llm.tiny_model import hf_greedy

    proc, folders = served
    folder = folders[name]
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (4, 19, 41)]
    client = openai.OpenAI(base_url=f"{proc.base()}/v1", api_key="unused")
    got = client.completions.create(model=name, prompt=prompts, max_tokens=32, temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    tokens = {c.index: [int(t.split(":")[1]) for t in c.logprobs.tokens] for c in got.choices}
    assert [tokens[i] for i in range(len(prompts))] == hf_greedy(folder, prompts, 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    echoed = client.completions.create(model=name, prompt=prompts[2], max_tokens=1, temperature=0, logprobs=0,
                                       echo=True, extra_body={"ignore_eos": True})
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompts[2]])).logits[0], dim=-1)
    want = [float(lp[i - 1, prompts[2][i]]) for i in range(1, len(prompts[2]))]
    assert echoed.choices[0].logprobs.token_logprobs[1 : len(prompts[2])] == pytest.approx(want, abs=2e-3)


@pytest.mark.llm
def test_unknown_architecture_and_missing_tensor_fail_their_own_load(served: tuple[PierProcess, dict]) -> None:
    proc, _ = served
    index = {row["name"]: row for row in requests.post(f"{proc.base()}/v2/repository/index", json={},
                                                       timeout=10).json()}
    unknown, missing = index["unknown_arch"], index["missing_tensor"]
    assert unknown["state"] == "UNAVAILABLE" and missing["state"] == "UNAVAILABLE"
    assert "unsupported architecture 'FalconForCausalLM'; supported: Gemma2ForCausalLM" in unknown["reason"]
    assert "Qwen3MoeForCausalLM" in unknown["reason"]
    assert "weight model.layers.1.self_attn.k_norm.weight missing" in missing["reason"], missing
    assert all(index[name]["state"] == "READY" for name in MODELS)
