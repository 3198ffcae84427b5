"""Speculative decoding with a draft model: greedy output equal to transformers and to decoding
without speculation (with the target itself as the draft, where every draft is accepted, and with a
truncated copy, where some are), across preemption and prefix caching with exact block accounting;
sampling whose distribution is unchanged; a draft with another tokenizer refused, naming what differs."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.spec_decode import SpeculativeConfig

from .test_spec_decode import GREEDY, SETTINGS, chi_square_limit, engine, sample_all, step_all, structured_and_forks
from .tiny_model import build_tokenizer, truncated_copy


def drafting(model: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(k, method="draft_model", model=model)


@pytest.fixture(scope="module")
def drafts(llama_dir: Path) -> Path:
    """`llama_dir` with a one-layer truncated copy of itself in its `trunc` subfolder (the engine
    reads only the folder's own *.safetensors)."""
    truncated_copy(llama_dir, llama_dir / "trunc", 1)
    return llama_dir


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("draft", [".", "trunc"])
def test_greedy_equals_transformers(drafts, repetitive, repetitive_reference, attention, draft):
    eng = engine(drafts, attention=attention, block_size=4, speculative_config=drafting(draft))
    assert step_all(eng, repetitive, GREEDY) == repetitive_reference
    spec = eng.stats().spec_decode
    assert spec is not None and spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    if draft == ".":  # the target as its own draft: its KV follows the target's, so every draft is accepted
        assert spec.num_accepted_tokens == spec.num_draft_tokens, spec
    else:
        assert spec.num_accepted_tokens < spec.num_draft_tokens, spec


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("draft", [".", "trunc"])
def test_greedy_across_preemption_and_prefix_caching(drafts, repetitive, repetitive_reference, mode, draft):
    # a block of 4 tokens: 2 KiB in the target, 2 or 1 KiB in the draft; 30 blocks cannot hold the four sequences
    per_block = 2048 + (2048 if draft == "." else 1024)
    eng = engine(drafts, kv_cache_memory_bytes=30 * per_block, block_size=4, preemption_mode=mode,
                 swap_space_bytes=200 * per_block, speculative_config=drafting(draft))
    assert eng.kv.pool.num_blocks == 30
    assert step_all(eng, repetitive, GREEDY) == repetitive_reference
    assert eng.stats().num_preemptions > 0
    again = step_all(eng, repetitive[:2], GREEDY)  # prefix-cache hits on blocks written under speculation
    assert again == repetitive_reference[:2]
    assert eng.stats().prefix_cache_hits > 0
    spec = eng.stats().spec_decode
    assert spec is not None and spec.num_accepted_tokens > 0
    if draft == ".":  # the draft's KV was preempted, swapped and reused from the prefix cache with the target's
        assert spec.num_accepted_tokens == spec.num_draft_tokens, spec


def test_structured_output_and_n_in_the_same_batch(drafts, repetitive, repetitive_reference):
    eng = engine(drafts, block_size=4, speculative_config=drafting("trunc", 3))
    structured_and_forks(eng, repetitive, repetitive_reference)


@pytest.fixture(scope="module")
def small_with_draft(small_vocab_dir: tuple[Path, list[int]]) -> tuple[Path, list[int]]:
    folder, prompt = small_vocab_dir
    truncated_copy(folder, folder / "trunc", 1)
    return folder, prompt


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_distribution_is_unchanged(small_with_draft, setting):
    """As with n-gram drafts (test_spec_decode): at each output position, the tokens' distribution
    with draft-model speculation against without, a two-sample chi-square test at p = 0.001; and a
    seeded request draws what it draws without speculation."""
    n = 1000
    a = sample_all(small_with_draft, False, n, SETTINGS[setting], seeded=False)
    b = sample_all(small_with_draft, True, n, SETTINGS[setting], seeded=False, config=drafting("trunc", 3))
    for pos in range(1, 5):
        ca, cb = Counter(o[pos] for o in a), Counter(o[pos] for o in b)
        cells = set(ca) | set(cb)
        stat = sum((ca[t] - cb[t]) ** 2 / (ca[t] + cb[t]) for t in cells)
        assert stat < chi_square_limit(max(len(cells) - 1, 1)), (pos, stat, sorted(ca.items()), sorted(cb.items()))
    seeded = sample_all(small_with_draft, False, 50, SETTINGS[setting], seeded=True)
    assert sample_all(small_with_draft, True, 50, SETTINGS[setting], seeded=True, config=drafting("trunc", 3)) == seeded


def copy_with(src: Path, dst: Path, change: str) -> Path:
    """A copy of `src` (weights and all) whose tokenizer differs from its own in one way."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("trunc", "other*"))
    tok = json.loads((dst / "tokenizer.json").read_text())
    if change == "vocabulary size":
        build_tokenizer(dst, vocab_size=300)
    elif change == "vocabulary":
        vocab = tok["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[100:102]
        vocab[a], vocab[b] = vocab[b], vocab[a]
    elif change == "added tokens":
        tok["added_tokens"][1]["content"] = "<|end|>"
    elif change == "eos_token":
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<s>"}))
    elif change == "pre-tokenizer":
        tok["pre_tokenizer"] = {"type": "Whitespace"}
    if change in ("vocabulary", "added tokens", "pre-tokenizer"):
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


@pytest.mark.parametrize("change, words", [
    ("vocabulary size", "its vocabulary has"),
    ("vocabulary", "its vocabulary differs (token 100 is"),
    ("added tokens", "its special (added) tokens differ"),
    ("eos_token", "its eos_token is '<s>', the served model's '</s>'"),
    ("pre-tokenizer", "its pre-tokenizer differs (Whitespace vs ByteLevel)"),
])
def test_a_draft_with_another_tokenizer_is_refused(llama_dir, change, words):
    name = "other_" + change.replace(" ", "_")
    copy_with(llama_dir, llama_dir / name, change)
    with pytest.raises(ValueError) as err:
        engine(llama_dir, speculative_config=drafting(name))
    assert "speculative_config: the draft model in" in str(err.value) and words in str(err.value), str(err.value)


def test_a_missing_draft_is_refused(llama_dir):
    with pytest.raises(ValueError, match=r"speculative_config: draft model 'nowhere': no config.json in .*nowhere"):
        LLMEngine.from_parameters(llama_dir, {"speculative_config": '{"model": "nowhere", "num_speculative_tokens": 2}',
                                              "kv_cache_memory_bytes": str(1 << 20)})
