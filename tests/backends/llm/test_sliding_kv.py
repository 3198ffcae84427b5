"""Sliding-window layers give back the blocks that fall out of their window (kv_groups.py,
kv_cache.py): greedy float32 output equal to transformers on Gemma 2 / Gemma 3 / Mistral with prompts
and generations far longer than the window; a sequence that fits only because those blocks go back
finishes without preemption; prefix-cache hits, preemption (swap and recompute), n-gram and draft
speculation and two tensor-parallel ranks equal the plain run; the block accounting holds in every
group after every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.kv_cache import NULL_BLOCK, KVCacheManager
from pier.backends.llm.sampling_params import SamplingParams
from pier.backends.llm.spec_decode import SpeculativeConfig

from .tiny_model import build_model, hf_greedy

WINDOW, BS, TOKENS = 8, 4, 40
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
MODELS = {  # arch, settings: a window of 8 tokens (two blocks of 4)
    # layers 0 and 2 slide: one full and one sliding group of two layers each
    "gemma2": ("gemma2", dict(num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                              attn_logit_softcapping=5.0, final_logit_softcapping=10.0, tie_word_embeddings=True,
                              random_norms=True)),
    # two sliding layers and one full one: three groups of one layer (two of them sliding)
    "gemma3": ("gemma3_text", dict(num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                   tie_word_embeddings=True, random_norms=True,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),  # every layer slides: one group
}
WINDOWS = {"gemma2": [0, WINDOW], "gemma3": [0, WINDOW, WINDOW], "mistral": [WINDOW]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sliding")
    return {name: build_model(root / name, arch, seed=21 + i, **settings)  # type: ignore[arg-type]
            for i, (name, (arch, settings)) in enumerate(MODELS.items())}


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (5, 30, 61)]


@pytest.fixture(scope="module")
def references(folders: dict[str, Path], long_prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(folder, long_prompts, TOKENS) for name, folder in folders.items()}


def engine(folder: Path, **kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_memory_bytes", 1 << 20)
    kw.setdefault("block_size", BS)
    kw.setdefault("max_num_batched_tokens", 16)
    return LLMEngine(folder, EngineConfig(**kw))  # type: ignore[arg-type]


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY, max_steps: int = 2000,
        drafts: int = 0) -> list[list[int]]:
    """Step to completion (at most `max_steps`), checking every group's block accounting after each
    step, and that a decoding sequence holds in a sliding group only the blocks of its window, the
    one written and those of its `drafts` speculative tokens."""
    base = len(eng._requests)
    ids = [f"r{base + i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            got[out.request_id].extend(out.token_ids)
        eng.kv.check()
        for seq in eng.scheduler.running:
            if seq.num_computed > seq.num_prompt and not seq.num_preemptions:  # decoding, not recomputing
                for g, w in enumerate(eng.kv.windows):
                    live = eng.kv.seqs[seq.seq_id].groups[g].live
                    assert not w or len(live) <= (w - 1) // BS + 2 + -(-drafts // BS), (g, len(live))
    assert not eng.has_unfinished(), "the requests did not finish"
    assert not eng.kv.seqs and eng.kv.pool.num_free == eng.kv.pool.num_blocks
    return [got[rid] for rid in ids]


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("name", list(MODELS))
def test_equals_transformers_far_past_the_window(folders, long_prompts, references, name, attention):
    eng = engine(folders[name], attention=attention)
    assert eng.kv.windows == WINDOWS[name]
    assert run(eng, long_prompts) == references[name]
    assert eng.stats().num_preemptions == 0


@pytest.mark.parametrize("name,blocks", [("gemma2", 34), ("mistral", 12)])
def test_out_of_window_blocks_make_room(folders, long_prompts, references, name, blocks):
    """The 101-token sequence needs 26 blocks in each group if every block is kept: 52 for Gemma 2's
    two groups (17 of twice the size with its four layers in one), 26 for Mistral's one; it finishes in
    34 and in 12 without a preemption because the sliding group gives blocks back, and the engine's
    peak block count says so."""
    eng = engine(folders[name], kv_cache_memory_bytes=blocks * block_bytes(folders[name], name))
    assert eng.kv.pool.num_blocks == blocks and eng.max_model_len >= 61 + TOKENS
    assert run(eng, long_prompts[2:], max_steps=400) == references[name][2:]
    stats = eng.stats()
    assert stats.num_preemptions == 0
    full = sum(1 for w in eng.kv.windows if not w) * -(-(61 + TOKENS) // BS)
    assert stats.peak_blocks_used <= full + (WINDOW - 1) // BS + 2 + 16 // BS  # + a prefill chunk's
    assert stats.peak_blocks_used < len(eng.kv.windows) * -(-(61 + TOKENS) // BS)


def block_bytes(folder: Path, name: str) -> int:
    """One block id's bytes: one layer's K and V per cache slot (the largest group's layer count)."""
    slots = {"gemma2": 2, "gemma3": 1, "mistral": 2}[name]
    heads, head_dim = 2, 32 if name != "mistral" else 16
    return slots * 2 * BS * heads * head_dim * 4


def test_prefix_hit_needs_only_the_window():
    """A sliding group's hit needs the blocks inside the window of the hit's end: with the early
    blocks evicted it is still whole, and the new sequence's table holds placeholders before it."""
    kv = KVCacheManager(20, BS, True, windows=[WINDOW])
    tokens = list(range(100, 128))  # 28 tokens: 7 full blocks
    assert kv.allocate("a", tokens, 0, 16) is not None
    for n in range(16, 28):  # decode-sized steps: blocks go back as the window moves
        assert kv.allocate("a", tokens, n, 1) is not None
        kv.check()
    gb = kv.seqs["a"].groups[0]  # position 27 sees 20 .. 27: blocks 0 .. 4 went back, 5 and 6 are held
    assert gb.first == 5 and gb.blocks[:5] == [NULL_BLOCK] * 5 and len(gb.live) == 2
    kv.free("a")
    keys = kv.computed_prefix("x", tokens).keys[0]
    taken = kv.pool.allocate(kv.pool.num_free - 7 + 2)  # every plain block, then the two given back first
    assert {kv.pool.lookup(k) for k in keys[:2]} == {None}
    kv.pool.release(taken)
    hit = kv.computed_prefix("b", tokens)  # 6 blocks (the last token is computed anew): window 17 .. 24
    assert hit.num_blocks == 6 and hit.firsts == [4]
    assert hit.tables[0] == [NULL_BLOCK] * 4 + [kv.pool.lookup(k) for k in keys[4:6]]
    assert kv.allocate("b", tokens, 24, 4, hit) is not None
    kv.check()
    kv.free("b")
    kv.check()


def test_hit_shortens_to_a_cached_window():
    """An evicted block inside the window of the hit's end: the hit ends where a whole window is cached."""
    kv = KVCacheManager(20, BS, True, windows=[WINDOW])
    tokens = list(range(200, 230))
    assert kv.allocate("a", tokens, 0, 30) is not None
    kv.free("a")  # blocks 6 .. 0 freed in that order: block 6 is evicted first
    keys = kv.computed_prefix("x", tokens).keys[0]
    taken = kv.pool.allocate(kv.pool.num_free - 7 + 1)
    assert kv.pool.lookup(keys[6]) is None and None not in [kv.pool.lookup(k) for k in keys[:6]]
    kv.pool.release(taken)
    hit = kv.computed_prefix("b", tokens)
    assert hit.num_blocks == 6 and hit.firsts == [(24 - WINDOW + 1) // BS]  # blocks 4 and 5 are its window
    kv.check()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_hits_equal_the_plain_run(folders, long_prompts, references, mode):
    """Six sequences (the prompts twice: the second wave hits the prefix cache) in 40 blocks: preempted."""
    folder = folders["gemma2"]
    eng = engine(folder, kv_cache_memory_bytes=40 * block_bytes(folder, "gemma2"), preemption_mode=mode,
                 swap_space_bytes=200 * block_bytes(folder, "gemma2"), enable_prefix_caching=True)
    assert run(eng, long_prompts + long_prompts) == references["gemma2"] * 2
    stats = eng.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert run(eng, long_prompts[1:]) == references["gemma2"][1:]  # hits on blocks of finished requests


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_equals_the_plain_run(folders, tmp_path_factory, repetitive, method):
    """n-gram drafts on Gemma 2; a full-attention Llama draft for Mistral, whose layers all slide
    (the draft's layers get a full-attention group of their own)."""
    name = "gemma2" if method == "ngram" else "mistral"
    folder = folders[name]
    if method == "ngram":
        spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        draft = build_model(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=3)
        spec = SpeculativeConfig(3, method="draft_model", model=str(draft))
    prompts = [p * 3 for p in repetitive]  # 39 .. 105 tokens: far past the window
    plain = run(engine(folder), prompts)
    eng = engine(folder, speculative_config=spec, kv_cache_memory_bytes=48 * block_bytes(folder, name) * (
        2 if method == "draft" else 1), preemption_mode="swap", swap_space_bytes=1 << 20)
    if method == "draft":
        assert eng.kv.windows == [WINDOW, 0]
    assert run(eng, prompts, drafts=4) == plain
    stats = eng.stats()
    assert stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens > 0


def test_two_ranks_equal_one(folders, long_prompts, references):
    folder = folders["gemma2"]
    two = engine(folder, tensor_parallel_size=2, num_threads=1, enable_prefix_caching=True,
                 kv_cache_memory_bytes=40 * block_bytes(folder, "gemma2") // 2)
    try:
        assert two.kv.windows == [0, WINDOW]
        assert run(two, long_prompts + long_prompts) == references["gemma2"] * 2
        assert two.stats().num_preemptions > 0 and two.stats().prefix_cache_hits > 0
    finally:
        two.close()
