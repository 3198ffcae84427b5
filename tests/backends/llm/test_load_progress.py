"""Progress of a long load (issue 32, part 5): the weights loader reports each shard and the bytes
read, and the engine hands the reports on, from its own process (core_messages.Progress) or a
thread, so that the server can say "loading weights: 3/5 shards" while a model loads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pier.backends.llm.async_engine import AsyncLLMEngine
from pier.backends.llm.core_client import EngineCoreClient
from pier.backends.llm.models.loader import STAGE, iter_weights, safetensors_files
from pier.backends.llm.sampling_params import SamplingParams
from pier.contract.backend import LoadProgress

from .tiny_model import build_model

PARAMS = {"kv_cache_memory_bytes": str(4 << 20)}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("sharded") / "model", "llama", shard_size="100KB")


def _check_weights(reports: list[LoadProgress], folder: Path) -> None:
    files = safetensors_files(folder)
    weights = [r for r in reports if r.stage == STAGE]
    total = sum(f.stat().st_size for f in files)
    assert len(files) >= 3 and weights[0] == LoadProgress(STAGE, 0, len(files), 0, total)
    assert weights[-1] == LoadProgress(STAGE, len(files), len(files), total, total)
    assert [r.done for r in weights] == sorted(r.done for r in weights)  # never backwards
    assert [r.bytes_done for r in weights] == sorted(r.bytes_done for r in weights)
    ends = [r for r in weights if r.bytes_done == sum(f.stat().st_size for f in files[:r.done])]
    assert [r.done for r in ends] == list(range(len(files) + 1))  # one report as each shard ends
    assert str(weights[-1]).startswith(f"loading weights: {len(files)}/{len(files)} shards, ")


def test_the_loader_reports_each_shard_and_the_bytes_read(sharded: Path) -> None:
    reports: list[LoadProgress] = []
    names = [name for name, _ in iter_weights(sharded, reports.append)]
    assert len(names) == len(set(names)) > 0
    _check_weights(reports, sharded)


def test_the_engine_process_sends_its_progress_before_it_is_ready(sharded: Path) -> None:
    reports: list[LoadProgress] = []
    eng = EngineCoreClient(sharded, PARAMS, {}, on_progress=reports.append)
    try:
        _check_weights(reports, sharded)  # all of it arrived before the client was made
        assert reports[-1] == LoadProgress("building the CPU kernels (compiled once, then cached)")
    finally:
        eng.shutdown()


def test_the_engine_on_a_thread_reports_the_same(sharded: Path) -> None:
    reports: list[LoadProgress] = []
    eng = AsyncLLMEngine.from_parameters(sharded, PARAMS, reports.append)
    try:
        _check_weights(reports, sharded)

        async def one() -> int:
            n = 0
            async for out in eng.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)):
                n += len(out.token_ids)
            return n

        assert asyncio.run(one()) == 3  # and it serves
    finally:
        eng.shutdown()
