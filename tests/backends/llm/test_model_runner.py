"""The model runner's seam: a SchedulerOutput (and the step's grammar bitmask) in, a ModelRunnerOutput out;
the sampler's per-sequence state lives in the runner from a sequence's first step to the step after it ends."""

from __future__ import annotations

import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams
from pier.backends.llm.scheduler_output import GrammarBitmask


def test_one_call_returns_the_step(llama_dir, prompts, reference):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    eng.add_request("a", prompts[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2))
    # n = 2 with top_k 1: both sequences take the best token (greedy refuses n > 1)
    eng.add_request("b", prompts[1], SamplingParams(max_tokens=4, temperature=1.0, top_k=1, ignore_eos=True, n=2))
    eng.add_request("e", prompts[2], SamplingParams(max_tokens=1, embed=True))
    so = eng.scheduler.schedule()
    assert [n.seq_id for n in so.new_seqs] == ["a#0", "b#0", "e#0"]
    out = eng.runner.execute(so)
    # b's child samples its first token from b's row, right after it
    assert out.seq_ids == ["a#0", "b#0", "b#1"]
    assert out.sampled_token_ids == [reference[0][0], reference[1][0], reference[1][0]]
    logprob, top = out.logprobs[0]
    assert logprob == max(top.values()) and len(top) == 2 and out.logprobs[1] is None
    assert list(out.pooled) == ["e#0"] and abs(sum(v * v for v in out.pooled["e#0"]) - 1) < 1e-5
    assert set(eng.runner.states) == {"a#0", "b#0", "b#1", "e#0"}
    outs = eng.outputs.process(so, out)  # the rest of the engine's step: b forks, e is answered
    assert sorted((o.request_id, o.index, o.finished) for o in outs) == [
        ("a", 0, False), ("b", 0, False), ("b", 1, False), ("e", 0, True)]

    # structured output: the bitmask shipped with the step decides, whatever the logits say
    eng.add_request("s", prompts[3], SamplingParams.from_json(
        {"max_tokens": 4, "temperature": 0, "structured_outputs": {"regex": "[a-z]+"}}))
    for rid in ("a", "b"):
        eng.abort(rid)
    so = eng.scheduler.schedule()
    assert sorted(so.finished_seq_ids) == ["a#0", "b#0", "b#1", "e#0"]
    words = (eng.model_config.vocab_size + 31) // 32
    allowed = 37 if reference[3][0] != 37 else 38
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    bitmask[0, allowed // 32] = 1 << (allowed % 32)
    out = eng.runner.execute(so, GrammarBitmask(["s#0"], bitmask))
    assert out.seq_ids == ["s#0"] and out.sampled_token_ids == [allowed]
    assert set(eng.runner.states) == {"s#0"}  # the ended sequences' states are gone
