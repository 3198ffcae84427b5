"""The engine-core protocol's typed messages (backends/llm/core_messages.py), both ways, with a
real engine: a command or an event that does not decode, or of a kind no one knows, fails
loudly (the log says what and why) and fails only the request it names; the others are served."""

from __future__ import annotations

import asyncio
import logging
import threading

import msgspec
import pytest
import zmq

from pier.backends.llm import core_messages as cm
from pier.backends.llm.config import EngineConfig
from pier.backends.llm.core_client import EngineCoreClient
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.engine_core import EngineCore
from pier.backends.llm.sampling_params import SamplingParams
from pier.ipc.messages import encode

PARAMS = {"kv_cache_memory_bytes": str(4 << 20)}


def test_the_core_refuses_only_the_command_it_cannot_read(llama_dir, prompts, capfd) -> None:
    """engine_core.EngineCore in this process, on inproc sockets: a broken Add is refused by its
    request id, an unknown kind is said on stderr (the server's log), a good Add is served."""
    ctx = zmq.Context()
    server_out, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, server_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    server_out.bind("inproc://commands")
    core_in.connect("inproc://commands")
    server_in.bind("inproc://events")
    core_out.connect("inproc://events")
    try:
        engine = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=4 << 20))
        server_out.send(msgspec.msgpack.encode(["Add", "broken", prompts[0], {"max_tokens": "many"}]))
        server_out.send(msgspec.msgpack.encode(["Abrot", 7]))  # a kind nobody knows, no request id
        server_out.send(encode(cm.Add("good", prompts[0], SamplingParams(max_tokens=3, temperature=0))))
        loop = threading.Thread(target=EngineCore(engine, core_in, core_out).run)
        loop.start()
        events: list[cm.Event] = []
        while not any(isinstance(e, cm.Outputs) and any(o.request_id == "good" and o.finished for o in e.outputs)
                      for e in events):
            assert server_in.poll(30_000)
            events.append(cm.EVENTS.decode(server_in.recv()))
        server_out.send(encode(cm.Stop()))
        loop.join(30)
        assert not loop.is_alive()
        refused = [e for e in events if isinstance(e, cm.Refused)]
        assert [r.request_id for r in refused] == ["broken"]
        assert "unreadable server-to-engine-core message 'Add'" in refused[0].message
        assert "Expected `int | null`, got `str`" in refused[0].message
        tokens = [t for e in events if isinstance(e, cm.Outputs) for o in e.outputs if o.request_id == "good"
                  for t in o.token_ids]
        assert len(tokens) == 3
        assert "unreadable server-to-engine-core message 'Abrot': unknown kind" in capfd.readouterr().err
    finally:
        for s in (server_out, core_in, core_out, server_in):
            s.close(linger=0)
        ctx.term()


@pytest.mark.slow
def test_the_client_fails_only_the_request_whose_event_it_cannot_read(llama_dir, prompts,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A real engine-core process serves two streams; events that do not decode, sent onto the
    client's socket as a core of another version might, fail the request they name and no other."""
    eng = EngineCoreClient(llama_dir, PARAMS, {})
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUSH)
    assert eng._core is not None
    rogue.connect(eng._core.addresses[1])

    async def stream(rid: str, n: int) -> list[int]:
        ids: list[int] = []
        async for out in eng.generate(prompts[1], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                      request_id=rid):
            ids += out.token_ids
            if rid == "victim" and len(ids) == 1:
                rogue.send(msgspec.msgpack.encode(["Refused", "victim", 42]))  # the message should be a str
                rogue.send(msgspec.msgpack.encode(["Refuesd", "stray", "typo"]))  # a kind nobody knows
        return ids

    async def main() -> list:
        return await asyncio.gather(stream("victim", 200), stream("stray", 200), stream("other", 12),
                                    return_exceptions=True)

    try:
        with caplog.at_level(logging.ERROR, logger="pier.llm"):
            victim, stray, other = asyncio.run(main())
        assert isinstance(victim, RuntimeError), victim
        assert "unreadable engine-core-to-server message 'Refused'" in str(victim)
        assert isinstance(stray, RuntimeError) and "message 'Refuesd': unknown kind" in str(stray)
        assert isinstance(other, list) and len(other) == 12
        assert "message 'Refuesd': unknown kind" in caplog.text
        assert len(asyncio.run(stream("after", 4))) == 4  # and the core serves on
    finally:
        rogue.close(linger=0)
        ctx.term()
        eng.shutdown()
