"""scheduling_policy "priority" (vLLM's): lower `priority` first, ties by arrival; under a small KV
budget the preemption victim is the lowest priority, latest arrival, so high-priority requests that
arrive last still finish first. Without the policy a non-zero priority is refused, as vLLM does."""

from __future__ import annotations

import pytest

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams


def _finish_order(llama_dir, prompts, policy: str) -> tuple[list[str], int]:
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=48 * 2048, block_size=4, max_num_seqs=3,
                                            scheduling_policy=policy))
    params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    for i in range(4):
        eng.add_request(f"low{i}", prompts[i], SamplingParams.from_json({**params, "priority": 10 if policy ==
                                                                         "priority" else 0}))
    order: list[str] = []
    for _ in range(3):  # the low ones are running when the high ones come
        order += [o.request_id for o in eng.step() if o.finished]
    for i in range(2):
        eng.add_request(f"high{i}", prompts[4 + i], SamplingParams.from_json(params))
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    return order, eng.stats().num_preemptions


def test_high_priority_requests_finish_first_and_preempt(llama_dir, prompts):
    order, preemptions = _finish_order(llama_dir, prompts, "priority")
    assert set(order[:2]) == {"high0", "high1"}, order
    assert preemptions > 0
    fcfs, _ = _finish_order(llama_dir, prompts, "fcfs")  # the same workload in arrival order
    assert set(fcfs[:2]) != {"high0", "high1"}, fcfs


def test_priority_without_the_policy_is_refused(llama_dir, prompts):
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
    with pytest.raises(ValueError, match="Got priority 3 but Priority scheduling is not enabled."):
        eng.add_request("r", prompts[0], SamplingParams.from_json({"priority": 3}))
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig.from_parameters({"scheduling_policy": "lottery"})
