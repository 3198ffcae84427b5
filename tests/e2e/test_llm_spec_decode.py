"""Speculative decoding served by a real `pier serve`, by n-gram prompt lookup and by a draft model
(a truncated copy of the served model, its folder given relative to the model's): greedy
completions equal transformers' greedy generate token for token, streamed and not, with vLLM's
spec_decode metrics moving; a malformed speculative_config or a draft model with another tokenizer
fails that model's load with a message naming the problem, and the other models serve meanwhile."""

from __future__ import annotations

import random

import pytest
import requests

from tests.conftest import PierProcess, start_pier

pytestmark = pytest.mark.llm

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
CONFIG = ('backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "4000000" } }\n'
          "parameters { key: \"speculative_config\" value { string_value: '%s' } }\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from tests.backends.llm.tiny_model import build_model, build_tokenizer, truncated_copy

    repo = tmp_path_factory.mktemp("spec") / "repo"
    folder = build_model(repo / "spec_llama" / "1", "llama")
    (repo / "spec_llama" / "config.pbtxt").write_text(CONFIG % SPEC)
    draft = '{"model": "draft", "num_speculative_tokens": 3}'
    for name, spec in (("bad_lookup", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, '
                                      '"prompt_lookup_max": 2}'),
                       ("draft_llama", draft), ("other_tokenizer", draft)):
        truncated_copy(build_model(repo / name / "1", "llama"), repo / name / "1" / "draft", 1)
        (repo / name / "config.pbtxt").write_text(CONFIG % spec)
    build_tokenizer(repo / "other_tokenizer" / "1" / "draft", vocab_size=300)
    proc = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false",
                      log_path=repo.parent / "pier.log", timeout=120)
    proc.model_dir = folder  # type: ignore[attr-defined]
    yield proc
    assert proc.stop() == 0, proc.log()


def metrics(server: PierProcess) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("vllm:spec_decode")}


@pytest.fixture(scope="module")
def reference(server: PierProcess) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (spans repeated, so prompt lookup hits, and one that is not) and transformers' greedy
    continuations (every model here has the same weights)."""
    from tests.backends.llm.tiny_model import hf_greedy

    rng = random.Random(5)
    prompts = []
    for n, reps in ((5, 4), (9, 3), (3, 7), (23, 1)):
        span = [rng.randrange(2, 320) for _ in range(n)]
        prompts.append(span * reps + span[: n // 2])
    return prompts, hf_greedy(server.model_dir, prompts, 40)  # type: ignore[attr-defined]


@pytest.mark.parametrize("model", ["spec_llama", "draft_llama"])
def test_greedy_equals_transformers_and_the_metrics_move(server: PierProcess, reference, model: str) -> None:
    client = openai.OpenAI(base_url=f"{server.base()}/v1", api_key="none")
    before = metrics(server)
    for prompt, ref in zip(*reference):
        body = dict(model=model, prompt=prompt, max_tokens=40, temperature=0, logprobs=0,
                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        c = client.completions.create(**body)  # type: ignore[call-overload]
        assert c.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ref]
        chunks = list(client.completions.create(**body, stream=True))  # type: ignore[call-overload]
        streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
        assert streamed == [f"token_id:{t}" for t in ref]
    after = metrics(server)
    labels = f'{{model_name="{model}"}}'
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        key = f"vllm:spec_decode_{name}_total{labels}"
        assert after[key] > before.get(key, 0), (name, before, after)
    assert after[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{model}",position="0"}}'] > 0
    assert after[f"vllm:spec_decode_num_accepted_tokens_total{labels}"] <= \
        after[f"vllm:spec_decode_num_draft_tokens_total{labels}"]


def test_bad_speculative_config_fails_that_load_with_the_field(server: PierProcess) -> None:
    index = {row["name"]: row for row in requests.post(f"{server.base()}/v2/repository/index", json={},
                                                         timeout=10).json()}
    assert index["spec_llama"]["state"] == "READY" and index["draft_llama"]["state"] == "READY"
    for name, words in (("bad_lookup", "speculative_config: prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
                        ("other_tokenizer", "has another tokenizer than the served model: its vocabulary has 300 "
                                            "tokens, the served model's 320")):
        assert index[name]["state"] == "UNAVAILABLE" and words in index[name]["reason"], index[name]
