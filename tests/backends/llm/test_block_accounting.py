"""Random workloads of finished, aborted and preempted requests return every block to the pool."""

from __future__ import annotations

import random

import pytest

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams


@pytest.mark.parametrize("mode,caching,seed", [
    ("recompute", True, 0), ("recompute", False, 1), ("swap", True, 2), ("swap", False, 3),
])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_random_workload_returns_every_block(llama_dir, mode, caching, seed, kv_dtype):
    """Under every combination of preemption mode, prefix caching and KV cache dtype (an FP8 block
    is a quarter of the float32 one's bytes: the budget keeps 28 blocks)."""
    rng = random.Random(seed)
    block_bytes = 2048 if kv_dtype == "auto" else 512
    eng = LLMEngine(llama_dir, EngineConfig(
        kv_cache_memory_bytes=28 * block_bytes, block_size=4, preemption_mode=mode, swap_space_bytes=24 * block_bytes,
        enable_prefix_caching=caching, max_num_seqs=8, max_num_batched_tokens=24, kv_cache_dtype=kv_dtype))
    assert eng.kv.pool.num_blocks == 28
    shared = [rng.randrange(2, 320) for _ in range(12)]
    live: set[str] = set()
    finished_reasons: dict[str, set[str]] = {}
    next_id = 0
    for _ in range(120):
        action = rng.random()
        if action < 0.25:
            prefix = shared if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(2, 320) for _ in range(rng.randrange(1, 20))]
            n = rng.choice([1, 1, 2])
            params = SamplingParams(max_tokens=rng.randrange(1, 50), temperature=0 if n == 1 else 0.8, n=n,
                                    seed=rng.randrange(100), ignore_eos=rng.random() < 0.5)
            rid = f"r{next_id}"
            next_id += 1
            eng.add_request(rid, prompt, params)
            live.add(rid)
        elif action < 0.35 and live:
            rid = rng.choice(sorted(live))
            for out in eng.abort(rid):
                finished_reasons.setdefault(rid, set()).add(out.finish_reason or "")
            live.discard(rid)
        for out in eng.step():
            if out.finished:
                finished_reasons.setdefault(out.request_id, set()).add(out.finish_reason or "")
        live &= set(eng._requests)
        eng.kv.check()
        held = sum(len(b.blocks) for b in eng.kv.seqs.values())
        assert held >= eng.kv.pool.num_blocks - eng.kv.pool.num_free  # shared blocks counted per holder
    while eng.has_unfinished():
        eng.step()
        eng.kv.check()
    assert eng.stats().num_preemptions > 0
    assert not eng.kv.seqs and not eng._requests
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks
    assert eng.kv.cpu_pool.num_free == eng.kv.cpu_pool.num_blocks
    assert {"abort", "length"} <= set().union(*finished_reasons.values())
