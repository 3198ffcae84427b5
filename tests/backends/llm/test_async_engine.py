"""AsyncLLMEngine and EngineCoreClient: streaming from the step thread (or the engine-core process),
and cancellation freeing blocks."""

from __future__ import annotations

import asyncio
import time

import pytest

from pier.backends.llm.async_engine import AsyncLLMEngine
from pier.backends.llm.config import EngineConfig
from pier.backends.llm.core_client import EngineCoreClient
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams


@pytest.fixture(params=["thread", pytest.param("process", marks=pytest.mark.slow)])
def aengine(request, llama_dir):
    """Both ways of running the engine behave the same to their callers."""
    if request.param == "thread":
        eng = AsyncLLMEngine(LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20)))
    else:
        eng = EngineCoreClient(llama_dir, {"kv_cache_memory_bytes": str(4 << 20)}, {})
    yield eng
    eng.shutdown()


def _wait_idle(eng: AsyncLLMEngine | EngineCoreClient) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s = eng.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {eng.stats()}")


def test_concurrent_streams_match_sync(aengine, prompts, reference):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def one(i: int) -> tuple[list[int], str, list]:
        ids: list[int] = []
        text = ""
        outs = []
        async for out in aengine.generate(prompts[i], params, request_id=f"r{i}"):
            ids += out.token_ids
            text += out.text
            outs.append(out)
        return ids, text, outs

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    results = asyncio.run(main())
    for (ids, text, outs), ref in zip(results, reference):
        assert ids == ref
        last = outs[-1]
        assert last.finished and last.finish_reason == "length" and last.completion_tokens == 24
        assert last.prompt_tokens > 0 and last.metrics is not None and last.metrics.first_token_time is not None
        assert text == aengine.tokenizer.decode(ref).rstrip("\ufffd")  # a character cut at the end is dropped
    _wait_idle(aengine)
    stats = aengine.stats()
    assert stats.generation_tokens == 24 * len(prompts)


def test_closing_the_iterator_aborts_and_frees_blocks(aengine, prompts):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        gen = aengine.generate(prompts[4], params, request_id="long")
        n = 0
        async for _ in gen:
            n += 1
            if n == 3:
                break
        await gen.aclose()
        return n

    assert asyncio.run(main()) == 3
    _wait_idle(aengine)


def test_cancelled_task_aborts(aengine, prompts):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        started = asyncio.Event()

        async def consume():
            async for _ in aengine.generate(prompts[3], params):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_idle(aengine)


def test_bad_prompt_raises_before_streaming(aengine):
    async def main():
        async for _ in aengine.generate(list(range(2, 600)), SamplingParams()):
            pass

    with pytest.raises(ValueError, match="maximum context length"):
        asyncio.run(main())


def test_n_streams_every_index(aengine, prompts):
    async def main():
        seen: dict[int, int] = {}
        async for out in aengine.generate(prompts[1], SamplingParams(max_tokens=5, n=3, seed=0, ignore_eos=True)):
            seen[out.index] = seen.get(out.index, 0) + len(out.token_ids)
        return seen

    assert asyncio.run(main()) == {0: 5, 1: 5, 2: 5}


def test_reset_prefix_cache(aengine, prompts):
    """vLLM's reset_prefix_cache: refused (False, nothing forgotten) while a request holds blocks;
    once idle it forgets every cached prefix, so the same prompt finds no cached block again."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = prompts[4]  # 64 tokens: several full blocks

    async def run_once() -> None:
        async for _ in aengine.generate(prompt, params):
            pass

    async def main() -> tuple[bool, bool, int, int]:
        await run_once()
        _wait_idle(aengine)
        hits = aengine.stats().prefix_cache_hits
        await run_once()  # found in the cache
        _wait_idle(aengine)
        cached = aengine.stats().prefix_cache_hits - hits
        long = aengine.generate(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        await anext(long)  # running: its blocks are in use
        busy = await aengine.reset_prefix_cache()
        await long.aclose()
        _wait_idle(aengine)
        idle = await aengine.reset_prefix_cache()
        hits = aengine.stats().prefix_cache_hits
        await run_once()
        _wait_idle(aengine)
        return busy, idle, cached, aengine.stats().prefix_cache_hits - hits

    busy, idle, cached, after = asyncio.run(main())
    assert cached > 0 and not busy and idle and after == 0
