"""Pier's greedy outputs are token-identical to transformers' greedy generate."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams

from .tiny_model import build_model, hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(params=["auto", "torch"])
def attention(request: pytest.FixtureRequest) -> str:
    """Both decode paths: the compiled kernel ("auto" on CPU float32) and the torch reference."""
    return request.param


def engine(folder: Path, **kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    return LLMEngine(folder, EngineConfig(**kw))  # type: ignore[arg-type]


def assert_drained(eng: LLMEngine) -> None:
    eng.kv.check()
    assert not eng.kv.seqs
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks
    assert eng.kv.cpu_pool.num_free == eng.kv.cpu_pool.num_blocks


def test_batch_of_different_lengths(llama_dir, prompts, reference, attention):
    eng = engine(llama_dir, attention=attention)
    out = eng.generate(prompts, GREEDY)
    assert [o[0] for o in out] == reference
    assert_drained(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption(llama_dir, prompts, reference, mode, attention):
    # 2 layers * 2 (K,V) * 4 tokens * 2 heads * 16 dims * 4 bytes = 2 KiB a block; 40 blocks = 160 tokens.
    eng = engine(llama_dir, attention=attention, kv_cache_memory_bytes=40 * 2048, block_size=4, preemption_mode=mode,
                 swap_space_bytes=200 * 2048, enable_prefix_caching=False)
    out = eng.generate(prompts, GREEDY)
    assert [o[0] for o in out] == reference
    assert eng.stats().num_preemptions > 0
    assert_drained(eng)


def test_prefix_caching_shared_prefix(llama_dir, attention):
    rng = random.Random(1)
    system = [rng.randrange(2, 320) for _ in range(45)]
    prompts = [system + [rng.randrange(2, 320) for _ in range(n)] for n in (1, 7, 20)]
    ref = hf_greedy(llama_dir, prompts, 24)
    eng = engine(llama_dir, attention=attention, block_size=8)
    first = eng.generate(prompts[:1], GREEDY)
    assert eng.stats().prefix_cache_hits == 0
    rest = eng.generate(prompts[1:], GREEDY)
    stats = eng.stats()
    assert stats.prefix_cache_hits >= 2 * 40  # both later prompts reuse the 5 full blocks of the prefix
    assert [o[0] for o in first + rest] == ref
    # the whole prompt cached: only the last token is recomputed
    again = eng.generate(prompts[:1], GREEDY)
    assert again[0][0] == ref[0]
    assert_drained(eng)


def test_chunked_prefill_long_prompt(llama_dir, prompts, reference, attention):
    rng = random.Random(2)
    long_prompt = [rng.randrange(2, 320) for _ in range(150)]
    ref_long = hf_greedy(llama_dir, [long_prompt], 24)[0]
    eng = engine(llama_dir, attention=attention, max_num_batched_tokens=32)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"short{i}", p, GREEDY)
    got: dict[str, list[int]] = {}
    for o in eng.step():  # the short prompts are admitted (26+ tokens)
        got.setdefault(o.request_id, []).extend(o.token_ids)
    eng.add_request("long", long_prompt, GREEDY)
    decodes_during_prefill = 0
    while eng.has_unfinished():
        long_seq = eng._requests.get("long", [None])[0]
        prefilling = long_seq is not None and long_seq.num_computed < len(long_prompt)
        outs = eng.step()
        if prefilling:
            decodes_during_prefill += sum(1 for o in outs if o.request_id != "long")
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert got["long"] == ref_long
    assert [got[f"short{i}"] for i in range(3)] == reference[:3]
    assert decodes_during_prefill > 0  # the short requests kept decoding while the long prompt was chunked
    assert_drained(eng)


@pytest.mark.parametrize("arch,extra", [
    ("qwen2", {}),
    ("mistral", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True}),
])
def test_other_architectures(tmp_path, prompts, arch, extra):
    folder = build_model(tmp_path / arch, arch, seed=3, **extra)
    ref = hf_greedy(folder, prompts[:4], 16)
    eng = engine(folder)
    out = eng.generate(prompts[:4], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o[0] for o in out] == ref


def test_sharded_weights(tmp_path, prompts):
    import transformers

    src = build_model(tmp_path / "src", "llama", seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    dst = tmp_path / "sharded"
    model.save_pretrained(dst, max_shard_size="100KB")
    assert (dst / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    ref = engine(src).generate(prompts[:2], GREEDY)
    assert engine(dst).generate(prompts[:2], GREEDY) == ref


def test_half_precision_runs(llama_dir, prompts):
    for dtype in ("bfloat16", "float16"):
        out = engine(llama_dir, dtype=dtype).generate(prompts[:2], GREEDY)
        assert all(len(o[0]) == 24 for o in out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (scripts/gpu_check.sh runs this)")
def test_cuda_matches_transformers_on_cuda(llama_dir, prompts):
    ref = hf_greedy(llama_dir, prompts, 24, device="cuda")
    eng = engine(llama_dir, device="cuda")
    assert eng.device.type == "cuda" and eng.runner.decode_op is None  # the torch paged-attention path
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == ref
    # a tiny block pool on the GPU: swapping blocks to CPU memory and back keeps the tokens
    eng = engine(llama_dir, device="cuda", kv_cache_memory_bytes=40 * 2048, block_size=4, preemption_mode="swap",
                 swap_space_bytes=200 * 2048, enable_prefix_caching=False)
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == ref
    assert eng.stats().num_preemptions > 0
    assert_drained(eng)


def test_prompt_logprobs_match_transformers(llama_dir, prompts):
    """prompt_logprobs (what echo + logprobs needs): every prompt token's logprob equals
    transformers' log-softmax at the previous position, with chunked prefill splitting prompts,
    and again for a repeated prompt whose blocks are in the prefix cache (they are recomputed)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    eng = engine(llama_dir, max_num_batched_tokens=24)  # the 40- and 64-token prompts run in chunks
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    for _ in range(2):  # the second pass finds every prompt's blocks cached
        for i, prompt in enumerate(prompts):
            eng.add_request(f"p{i}", prompt, params)
        got: dict[str, list] = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.prompt_logprobs is not None:
                    assert out.request_id not in got  # sent once
                    got[out.request_id] = out.prompt_logprobs
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            entries = got[f"p{i}"]
            assert [t for t, _, _ in entries] == prompt and entries[0][1:] == (None, None)
            want = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
            assert [lp for _, lp, _ in entries[1:]] == pytest.approx(want, abs=1e-4)
            for p, (_, _, top) in enumerate(entries[1:], start=1):
                assert len(top) == 2 and max(top.values()) == pytest.approx(float(ref[p - 1].max()), abs=1e-4)
    assert_drained(eng)


def test_logprob_outputs_carry_the_prompt_once(llama_dir, prompts):
    """With logprobs asked for, each sequence's first output carries the prompt's ids (its first
    token is decoded after them), later ones do not; n > 1 children carry it too."""
    eng = engine(llama_dir)
    eng.add_request("a", prompts[0], SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=2, logprobs=0,
                                                    ignore_eos=True))
    eng.add_request("b", prompts[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    seen: dict[tuple[str, int], list] = {}
    while eng.has_unfinished():
        for out in eng.step():
            seen.setdefault((out.request_id, out.index), []).append(out.prompt_ids)
    assert seen[("a", 0)] == [prompts[0], None, None] and seen[("a", 1)] == [prompts[0], None, None]
    assert seen[("b", 0)] == [None, None, None]  # no logprobs: nothing to decode after
