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

from tests.conftest import PierProcess, start_pier

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

# name -> (build_model arch, its settings): small windows so that the prompts pass them
MODELS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", {"head_dim": 32, "random_norms": True}),
    "gemma2": ("gemma2", {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0,
                          "tie_word_embeddings": True, "random_norms": True}),
    "gemma3": ("gemma3_text", {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
                               "tie_word_embeddings": True, "random_norms": True,
                               "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 8, "pad_token_id": 0}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 12}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                "mlp_only_layers": [1], "norm_topk_prob": True}),
}
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
