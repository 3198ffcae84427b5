"""Embedding requests in the engine (vLLM's embed runner for decoder models: the last prompt
token's final hidden state, L2-normalised) against transformers on the same weights, alone and in
a batch with generating requests, from a cold and a prefix-cached prompt."""

from __future__ import annotations

import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams


def _reference(llama_dir, prompts):
    import transformers

    model = transformers.AutoModel.from_pretrained(llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
                for p in prompts]


def _embed(eng: LLMEngine, prompts, also_generate: bool = False) -> list[torch.Tensor]:
    for i, p in enumerate(prompts):
        eng.add_request(f"e{i}", p, SamplingParams(max_tokens=1, embed=True))
        if also_generate:
            eng.add_request(f"g{i}", p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    got: dict[str, list[float]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.embedding is not None:
                assert out.finished and out.token_ids == [] and out.completion_tokens == 0
                got[out.request_id] = out.embedding
    return [torch.tensor(got[f"e{i}"]) for i in range(len(prompts))]


def test_embeddings_match_transformers(llama_dir, prompts):
    ref = _reference(llama_dir, prompts)
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    for got in (_embed(eng, prompts), _embed(eng, prompts, also_generate=True), _embed(eng, prompts)):
        for g, r in zip(got, ref):
            assert abs(float(g.norm()) - 1.0) < 1e-5
            assert float(torch.dot(g, r)) > 0.9999, float(torch.dot(g, r))
