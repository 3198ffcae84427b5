"""The engine-core process: its death fails what is in flight at once, naming the cause; it is
restarted (bounded) and serves again; nothing is left behind after shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from pier.backends.llm import core_client
from pier.backends.llm.async_engine import EngineDeadError
from pier.backends.llm.core_client import EngineCoreClient
from pier.backends.llm.sampling_params import SamplingParams
from pier.ipc.processes import exit_cause

PARAMS = {"kv_cache_memory_bytes": str(4 << 20)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


async def _collect(eng: EngineCoreClient, prompt: list[int], max_tokens: int) -> list[int]:
    ids: list[int] = []
    async for out in eng.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)):
        ids += out.token_ids
    return ids


def test_exit_cause() -> None:
    assert exit_cause(-9) == "killed by signal 9 (SIGKILL)"
    assert exit_cause(3) == "exited with code 3"


@pytest.mark.slow
def test_kill_fails_in_flight_then_restarts(llama_dir, prompts) -> None:
    health: list[str | None] = []
    eng = EngineCoreClient(llama_dir, PARAMS, {}, on_health=health.append)
    first = eng.pid
    try:
        reference = asyncio.run(_collect(eng, prompts[1], 8))

        async def killed_mid_stream() -> BaseException | None:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in eng.generate(prompts[4], SamplingParams(max_tokens=400, temperature=0,
                                                                       ignore_eos=True)):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            os.kill(first, signal.SIGKILL)
            try:
                await asyncio.wait_for(task, 10)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                return exc
            return None

        exc = asyncio.run(killed_mid_stream())
        assert isinstance(exc, EngineDeadError), exc
        assert f"pid {first}" in str(exc) and "killed by signal 9 (SIGKILL)" in str(exc)
        _wait(lambda: None in health)  # restarted
        assert health[0] is not None and "SIGKILL" in health[0]
        assert eng.pid != first and _alive(eng.pid) and not _alive(first)
        assert asyncio.run(_collect(eng, prompts[1], 8)) == reference  # same weights, same greedy answer
    finally:
        second = eng.pid
        eng.shutdown()
    assert not _alive(second)


@pytest.mark.slow
def test_restarts_are_bounded(llama_dir, prompts, monkeypatch) -> None:
    monkeypatch.setattr(core_client, "MAX_RESTARTS", 1)
    health: list[str | None] = []
    eng = EngineCoreClient(llama_dir, PARAMS, {}, on_health=health.append)
    try:
        os.kill(eng.pid, signal.SIGKILL)
        _wait(lambda: None in health)  # restarted once (its progress lines come before the None)
        after = len(health)
        os.kill(eng.pid, signal.SIGKILL)
        _wait(lambda: any(h is not None and "not restarted" in h for h in health[after:]))
        assert None not in health[after:]  # the second death was not restarted
        assert health[-1] is not None and "not restarted" in health[-1]
        with pytest.raises(EngineDeadError, match="not restarted"):
            asyncio.run(_collect(eng, prompts[1], 4))
    finally:
        eng.shutdown()


def test_load_failure_names_the_reason(tmp_path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        EngineCoreClient(tmp_path, PARAMS, {})


@pytest.mark.slow
def test_bad_request_is_refused_by_the_core(llama_dir, prompts) -> None:
    eng = EngineCoreClient(llama_dir, PARAMS, {})
    try:
        async def too_many() -> None:
            async for _ in eng.generate(prompts[0], SamplingParams(max_tokens=4, logprobs=50)):
                pass

        with pytest.raises(ValueError, match="greater than max allowed"):
            asyncio.run(too_many())
        assert len(asyncio.run(_collect(eng, prompts[0], 4))) == 4  # and it keeps serving
    finally:
        eng.shutdown()


def test_the_cores_log_lines_reach_the_servers_log(llama_dir, caplog) -> None:
    """What the core logs while it loads (here the line saying which quantization runs) is said on
    the server's log under the core's logger name and level: before, its INFO lines went nowhere."""
    caplog.set_level(logging.INFO)
    eng = EngineCoreClient(llama_dir, {**PARAMS, "quantization": "int8"}, {})
    try:
        lines = [r for r in caplog.records if r.name.endswith("models.quantization")]
        assert lines and lines[0].levelno == logging.INFO and "int8" in lines[0].getMessage(), caplog.text
    finally:
        eng.shutdown()
