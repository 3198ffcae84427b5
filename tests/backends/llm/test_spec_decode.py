"""Speculative decoding with n-gram prompt lookup: the proposer, the speculative_config parameter,
greedy output equal to transformers and to decoding without speculation (across preemption and
prefix caching, with exact block accounting), and sampling whose distribution is unchanged."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams
from pier.backends.llm.spec_decode import SpeculativeConfig, ngram_lookup

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
SMALL_NGRAM = SpeculativeConfig(3, 1, 3)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def lookup(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    return ngram_lookup(np.array(tokens), lo, hi, k)


def test_ngram_lookup_longest_match_at_the_earliest_position():
    assert lookup([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]  # vLLM's docstring case
    assert lookup([7, 2, 3, 9, 1, 2, 3, 8, 2, 3], 2, 3, 2) == [9, 1]  # [2, 3] first at 1, not at 5
    assert lookup([1, 2, 3, 5, 9, 2, 3, 6, 1, 2, 3], 2, 3, 2) == [5, 9]  # [1, 2, 3] (3 tokens) wins over [2, 3]
    assert lookup([5, 6, 7, 8], 1, 3, 4) == []  # no earlier occurrence
    assert lookup([4, 4], 2, 5, 3) == []  # shorter than prompt_lookup_min + 1
    assert lookup([4, 4, 4, 4], 1, 2, 8) == [4, 4]  # up to the end of the context


def parse(text: str) -> SpeculativeConfig | None:
    return EngineConfig.from_parameters({"speculative_config": text}).scheduler.speculative_config


def test_speculative_config_parses_as_vllm():
    assert parse("") is None
    assert parse('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(3, 5, 5)
    only_max = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert parse(only_max) == SpeculativeConfig(3, 4, 4)
    assert parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, '
                 '"prompt_lookup_max": 4}') == SpeculativeConfig(2, 2, 4)
    assert parse('{"model": "[ngram]", "num_speculative_tokens": 2}') == SpeculativeConfig(2, 5, 5)
    draft = SpeculativeConfig(3, method="draft_model", model="../draft")
    assert parse('{"model": "../draft", "num_speculative_tokens": 3}') == draft
    assert parse('{"method": "draft_model", "model": "../draft", "num_speculative_tokens": 3}') == draft


@pytest.mark.parametrize("text, words", [
    ("{nope", "speculative_config is not valid JSON"),
    ("[1, 2]", "speculative_config must be a JSON object"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be between 1 and 32"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min=5 must be <= prompt_lookup_max=2"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}',
     "prompt_lookup_min must be at least 1"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "unsupported field(s) lookahead"),
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method 'eagle' is not supported"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}', "method 'draft_model' needs 'model'"),
    ('{"model": "small", "num_speculative_tokens": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_max only apply to method 'ngram'"),
    ('{"model": "small"}', "num_speculative_tokens is required for method 'draft_model'"),
    ('{"method": "ngram", "model": "small", "num_speculative_tokens": 4}', "method 'ngram' takes no 'model'"),
])
def test_bad_speculative_config_names_the_field(text, words):
    with pytest.raises(ValueError) as err:
        parse(text)
    assert str(err.value).startswith("parameter speculative_config")
    assert words in str(err.value)


def engine(folder: Path, **kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    return LLMEngine(folder, EngineConfig(**kw))  # type: ignore[arg-type]


def step_all(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Run to completion, checking the block accounting after every step: each running sequence
    holds exactly the blocks of its computed tokens, and its prefix-cache hashes cover its own
    (accepted) tokens only."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    bs = eng.kv.block_size
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.token_ids)
        eng.kv.check()
        for seq in eng.scheduler.running:
            sb = eng.kv.seqs[seq.seq_id]
            assert len(sb.blocks) == -(-seq.num_computed // bs), seq.seq_id
            assert seq.num_computed <= len(seq.token_ids)
            for j, key in enumerate(sb.keys):
                assert key[1] == tuple(seq.token_ids[j * bs : (j + 1) * bs])
    assert not eng.kv.seqs and eng.kv.pool.num_free == eng.kv.pool.num_blocks
    return [got[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_greedy_equals_transformers_and_no_speculation(llama_dir, repetitive, repetitive_reference, attention):
    eng = engine(llama_dir, attention=attention, block_size=4, speculative_config=NGRAM)
    assert step_all(eng, repetitive, GREEDY) == repetitive_reference
    spec = eng.stats().spec_decode
    assert spec is not None and spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert spec.num_draft_tokens >= spec.num_accepted_tokens
    assert len(spec.accepted_per_pos) == 4 and spec.accepted_per_pos[0] >= spec.accepted_per_pos[-1]
    plain = engine(llama_dir, attention=attention, block_size=4)
    assert plain.generate(repetitive, GREEDY) == [[r] for r in repetitive_reference]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_across_preemption_and_prefix_caching(llama_dir, repetitive, repetitive_reference, mode):
    # 2 KiB a block of 4 tokens: 30 blocks cannot hold the four sequences at once
    eng = engine(llama_dir, kv_cache_memory_bytes=30 * 2048, block_size=4, preemption_mode=mode,
                 swap_space_bytes=200 * 2048, speculative_config=NGRAM)
    assert step_all(eng, repetitive, GREEDY) == repetitive_reference
    assert eng.stats().num_preemptions > 0
    again = step_all(eng, repetitive[:2], GREEDY)  # prefix-cache hits on blocks written under speculation
    assert again == repetitive_reference[:2]
    assert eng.stats().prefix_cache_hits > 0


def test_a_small_token_budget_trims_the_drafts(llama_dir, repetitive, repetitive_reference):
    eng = engine(llama_dir, block_size=4, max_num_batched_tokens=6, speculative_config=NGRAM)
    assert step_all(eng, repetitive, GREEDY) == repetitive_reference


def test_max_tokens_and_stop_tokens_cut_inside_accepted_drafts(llama_dir, repetitive, repetitive_reference):
    eng = engine(llama_dir, block_size=4, speculative_config=NGRAM)
    for n in (1, 7, 13):
        assert step_all(eng, repetitive, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) == [
            r[:n] for r in repetitive_reference]
    stop = repetitive_reference[0][9]
    got = step_all(eng, repetitive[:1], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop],
                                                       include_stop_str_in_output=True))
    assert got[0] == repetitive_reference[0][: repetitive_reference[0].index(stop) + 1]


def test_logprobs_are_the_targets(llama_dir, repetitive):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    outs: dict[bool, list[tuple[list[int], list[float]]]] = {}
    for spec in (False, True):
        eng = engine(llama_dir, block_size=4, speculative_config=NGRAM if spec else None)
        for i, p in enumerate(repetitive):
            eng.add_request(f"r{i}", p, params)
        got: dict[str, tuple[list[int], list[float]]] = {f"r{i}": ([], []) for i in range(len(repetitive))}
        while eng.has_unfinished():
            for o in eng.step():
                assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
                got[o.request_id][0].extend(o.token_ids)
                got[o.request_id][1].extend(lp for lp, _ in o.logprobs)
        outs[spec] = [got[f"r{i}"] for i in range(len(repetitive))]
    for (ids_a, lp_a), (ids_b, lp_b) in zip(outs[False], outs[True]):
        assert ids_a == ids_b
        assert max(abs(a - b) for a, b in zip(lp_a, lp_b)) < 1e-4


SETTINGS = {
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p_min_p": dict(temperature=0.8, top_p=0.9, min_p=0.1),
    "penalties_bias": dict(temperature=1.0, top_k=6, repetition_penalty=1.3, presence_penalty=0.5,
                           logit_bias={"7": 2.0}),
}


def sample_all(model: tuple[Path, list[int]], spec: bool, n: int, setting: dict[str, object], seeded: bool,
               config: SpeculativeConfig = SMALL_NGRAM) -> list[list[int]]:
    folder, prompt = model
    eng = engine(folder, block_size=4, speculative_config=config if spec else None)
    torch.manual_seed(1234)
    params = [SamplingParams.from_json({**setting, "max_tokens": 5, "ignore_eos": True,
                                        **({"seed": i} if seeded else {})}) for i in range(n)]
    out = [o[0] for o in eng.generate([prompt] * n, params)]
    if spec:
        stats = eng.stats().spec_decode
        assert stats is not None and stats.num_accepted_tokens > n // 10, stats
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_seeded_sampling_draws_what_it_draws_without_speculation(small_vocab_dir, setting):
    """A seeded request samples each position once from its own generator, with or without drafts."""
    a = sample_all(small_vocab_dir, False, 100, SETTINGS[setting], seeded=True)
    b = sample_all(small_vocab_dir, True, 100, SETTINGS[setting], seeded=True)
    assert a == b


def chi_square_limit(dof: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; no scipy needed)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_distribution_is_unchanged(small_vocab_dir, setting):
    """Unseeded sampling (the batch's shared generator): at each output position the drafts can
    reach, the tokens' distribution with speculation against without, a two-sample chi-square test
    at p = 0.001. Deterministic: the global generator is seeded."""
    n = 1000
    a = sample_all(small_vocab_dir, False, n, SETTINGS[setting], seeded=False)
    b = sample_all(small_vocab_dir, True, n, SETTINGS[setting], seeded=False)
    for pos in range(1, 5):
        ca, cb = Counter(o[pos] for o in a), Counter(o[pos] for o in b)
        cells = set(ca) | set(cb)
        stat = sum((ca[t] - cb[t]) ** 2 / (ca[t] + cb[t]) for t in cells)
        assert stat < chi_square_limit(max(len(cells) - 1, 1)), (pos, stat, sorted(ca.items()), sorted(cb.items()))


def structured_and_forks(eng: LLMEngine, repetitive: list[list[int]], repetitive_reference: list[list[int]]) -> None:
    """A structured-output request, a greedy one and an n=3 sampled one in the same batch of a
    speculating engine: the text matches its grammar, greedy equals the reference, each fork ends."""
    regex = r"(ab|cd){3,6}"
    eng.add_request("structured", repetitive[0], SamplingParams.from_json(
        {"max_tokens": 30, "temperature": 0, "structured_outputs": {"regex": regex}}))
    eng.add_request("greedy", repetitive[1], GREEDY)
    eng.add_request("forks", repetitive[2], SamplingParams(max_tokens=20, temperature=1.0, n=3, seed=7,
                                                           ignore_eos=True))
    text, tokens, forks = "", [], {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == "structured":
                text += o.text
            elif o.request_id == "greedy":
                tokens.extend(o.token_ids)
            else:
                forks[o.index] = forks.get(o.index, 0) + len(o.token_ids)
    assert re.fullmatch(regex, text), text
    assert tokens == repetitive_reference[1]
    assert forks == {0: 20, 1: 20, 2: 20}


def test_structured_output_and_n_in_the_same_batch(llama_dir, repetitive, repetitive_reference):
    """A structured-output request decodes without drafts (its grammar masks every token it
    emits) beside speculating ones; n > 1 forks keep working."""
    eng = engine(llama_dir, block_size=4, speculative_config=NGRAM)
    structured_and_forks(eng, repetitive, repetitive_reference)
    spec = eng.stats().spec_decode
    assert spec is not None and spec.num_accepted_tokens > 0
