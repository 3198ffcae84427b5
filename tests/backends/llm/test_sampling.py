"""SamplingParams validation, seeded sampling, n > 1, stop conditions, logprobs."""

from __future__ import annotations

import pytest

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams


def test_from_json_accepts_vllm_names():
    p = SamplingParams.from_json({
        "max_tokens": "32", "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "seed": 7,
        "stop": "###", "stop_token_ids": [3], "ignore_eos": "true", "n": 2, "logprobs": 2,
    })
    assert p.max_tokens == 32 and p.top_k == 5 and p.stop == ("###",) and p.ignore_eos and p.n == 2
    with pytest.raises(ValueError, match="unsupported sampling parameter\\(s\\): best_of, use_beam_search"):
        SamplingParams.from_json({"use_beam_search": True, "best_of": 2, "temperature": 1})  # never ignored


@pytest.mark.parametrize("body,word", [
    ({"max_tokens": -3}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"n": 0}, "n"), ({"max_tokens": "many"}, "max_tokens"),
    ({"stop": [1]}, "stop"), ({"n": 2, "temperature": 0}, "greedy"), ({"repetition_penalty": 0}, "repetition"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": -1}, "logprobs"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"seed": 2**70}, "seed"),  # a fork's generator would fail a step
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_from_json_rejects_bad_values(body, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams.from_json(body)


def _run(eng: LLMEngine, prompts, params):
    return eng.generate(prompts, params)


def test_seeded_sampling_reproducible_and_batch_independent(llama_dir, prompts):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=123,
                            repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3, ignore_eos=True)
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    a = _run(eng, prompts, params)
    b = _run(eng, prompts, params)
    assert a == b
    alone = _run(eng, [prompts[2]], params)
    assert alone[0] == a[2]  # the same tokens whatever else shares the batch
    other_seed = _run(eng, prompts, SamplingParams(**{**params.__dict__, "seed": 124, "stop": ()}))
    assert other_seed != a


def test_n_greater_than_one_shares_prompt_blocks(llama_dir, prompts):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20, block_size=8))
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=5, ignore_eos=True)
    eng.add_request("r", prompts[4], params)  # 64 tokens = 8 full blocks
    eng.step()
    seqs = eng._requests["r"]
    assert len(seqs) == 3
    tables = [eng.kv.block_table(s.seq_id) for s in seqs]
    assert tables[0][:8] == tables[1][:8] == tables[2][:8]  # the prompt's blocks are shared
    outs: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.index, []).extend(o.token_ids)
    assert sorted(outs) == [0, 1, 2] and all(len(v) == 11 for v in outs.values())
    assert len({tuple(v) for v in outs.values()}) > 1
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks


def test_n_with_partial_block_copy_on_write(llama_dir, prompts):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20, block_size=8))
    params = SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=1, ignore_eos=True)
    got = eng.generate([prompts[2]], params)[0]  # 40 + 1 tokens: a partly filled shared block
    assert len(got) == 2 and all(len(g) == 6 for g in got)
    # a child must continue exactly as a single request would with the same first token
    eng.kv.check()


def test_eos_stops_with_no_stop_reason(llama_dir, prompts):
    """As vLLM: EOS finishes with stop_reason None (a stop token id names itself), even when the
    stop_token_ids list holds the EOS id too."""
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    eos = sorted(eng.eos_ids)[0]
    for stop_ids in ((), (eos,)):
        eng.add_request("e", prompts[0], SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100},
                                                        stop_token_ids=stop_ids))
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None, stop_ids
    eng.add_request("i", prompts[0], SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100},
                                                    stop_token_ids=[eos], ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].stop_reason == eos  # with ignore_eos it stops as a stop token


def test_stop_token_ids_eos_and_max_tokens(llama_dir, prompts):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    greedy = eng.generate([prompts[0]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0][0]
    stop_tok = greedy[3]
    eng.add_request("s", prompts[0], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_tok]))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_tok
    assert sum(len(o.token_ids) for o in outs) == greedy.index(stop_tok) + 1
    eng.add_request("m", prompts[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 4


def test_stop_string_in_engine(llama_dir, prompts):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    eng.add_request("a", prompts[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    text = ""
    while eng.has_unfinished():
        text += "".join(o.text for o in eng.step())
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    eng.add_request("b", prompts[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    got = "".join(o.text for o in outs)
    assert got == text[: text.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_logprobs(llama_dir, prompts):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    eng.add_request("l", prompts[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    for o in outs:
        (lp, top), = o.logprobs
        assert lp <= 0 and len(top) == 2
        assert o.token_ids[0] == max(top, key=top.get)  # greedy picks the most likely token
        assert abs(top[o.token_ids[0]] - lp) < 1e-6


def test_logit_bias(llama_dir, prompts):
    """OpenAI's logit_bias: {"token id": bias} added to the logits before choosing (greedy too),
    clamped to [-100, 100]; returned logprobs stay the model's own; ids outside the vocabulary fail."""
    p = SamplingParams.from_json({"logit_bias": {"7": 250, 9: -3.5}})
    assert dict(p.logit_bias) == {7: 100.0, 9: -3.5}
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    forced = _run(eng, prompts[:2], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={7: 100}))
    assert forced == [[[7] * 5], [[7] * 5]]
    plain = _run(eng, prompts[:1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0][0]
    banned = _run(eng, prompts[:1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                   logit_bias={plain[0]: -100}))[0][0]
    assert banned[0] != plain[0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("oov", prompts[0], SamplingParams(logit_bias={10**6: 1}))


def _collect(eng: LLMEngine, rid: str, prompt, params: SamplingParams) -> tuple[str, list]:
    eng.add_request(rid, prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return "".join(o.text for o in outs), outs


def test_stop_token_text_left_out_unless_asked(llama_dir, prompts):
    """As vLLM: the token that stops a sequence (a stop_token_id, or EOS) adds no text unless
    include_stop_str_in_output; min_tokens also holds back stop strings."""
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    full, _ = _collect(eng, "f", prompts[1], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    greedy = eng.generate([prompts[1]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0][0]
    stop_tok = greedy[3]
    cut = greedy.index(stop_tok)
    stopping = {"max_tokens": 10, "temperature": 0, "stop_token_ids": [stop_tok]}
    without, outs = _collect(eng, "a", prompts[1], SamplingParams(**stopping))
    with_it, _ = _collect(eng, "b", prompts[1], SamplingParams(**stopping, include_stop_str_in_output=True))
    assert outs[-1].completion_tokens == cut + 1 and outs[-1].stop_reason == stop_tok
    assert with_it.startswith(without) and len(with_it) > len(without) and full.startswith(with_it)
    first_char = full.lstrip()[:1]  # appears within the first token or two
    quick, q_outs = _collect(eng, "c", prompts[1], SamplingParams(max_tokens=8, temperature=0, stop=[first_char]))
    held, h_outs = _collect(eng, "d", prompts[1], SamplingParams(max_tokens=8, temperature=0, stop=[first_char],
                                                                 min_tokens=5, ignore_eos=True))
    assert q_outs[-1].finish_reason == "stop" and q_outs[-1].completion_tokens < 5
    assert h_outs[-1].completion_tokens >= 5


def test_n_is_bounded_by_max_num_seqs(llama_dir, prompts):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20, max_num_seqs=8))
    with pytest.raises(ValueError, match="n=9 cannot be greater than max_num_seqs=8"):
        eng.add_request("big", prompts[0], SamplingParams(max_tokens=1, n=9, temperature=1.0))
    with pytest.raises(ValueError, match="greater than max allowed: 20"):  # a topk past the vocab would fail a step
        eng.add_request("lp", prompts[0], SamplingParams(max_tokens=1, logprobs=10**6))
    with pytest.raises(ValueError, match="prompt logprobs of 1000000, which is greater than max allowed: 20"):
        eng.add_request("plp", prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=10**6))
    assert not eng.has_unfinished()


@pytest.mark.parametrize("body,word", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
])
def test_non_finite_values_are_refused(body, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams.from_json(body)


def test_one_requests_extreme_values_do_not_fail_the_others(llama_dir, prompts):
    """Values that pass validation but leave a row with no usable logit (every token masked by
    min_tokens + stop_token_ids, a penalty that overflows) sample from the raw logits: the step,
    and every other request in it, goes on."""
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    vocab = eng.model_config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.add_request("x", prompts[0], SamplingParams(max_tokens=3, stop_token_ids=[vocab]))
    with pytest.raises(ValueError, match="stop strings"):
        eng.add_request("y", prompts[0], SamplingParams(max_tokens=3, stop=[f"s{i}" for i in range(257)]))
    eng.add_request("masked", prompts[0], SamplingParams(max_tokens=3, temperature=1.0, min_tokens=3,
                                                         stop_token_ids=list(range(vocab))))
    eng.add_request("overflow", prompts[1], SamplingParams(max_tokens=3, temperature=1.0, repetition_penalty=1e-45))
    eng.add_request("normal", prompts[2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.completion_tokens
    assert done == {"masked": 3, "overflow": 3, "normal": 3}


def test_text_far_past_the_context_is_refused_before_tokenizing(llama_dir):
    """The tokenizer holds the GIL: text that cannot fit max_model_len tokens at 64 characters a
    token is refused without tokenizing it (instantly), as is a token-id list past the context."""
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))

    def never(*args, **kwargs):
        raise AssertionError("the tokenizer was called")

    encode, eng.tokenizer.encode = eng.tokenizer.encode, never
    with pytest.raises(ValueError, match="characters long"):
        eng.add_request("huge", "ab " * (eng.max_model_len * 64), SamplingParams(max_tokens=1))
    eng.tokenizer.encode = encode
    with pytest.raises(ValueError, match="maximum context length"):
        eng.add_request("ids", list(range(eng.max_model_len + 5)), SamplingParams(max_tokens=1))
