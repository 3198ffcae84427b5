"""The frontend protocol's typed messages (server/frontends/workers/messages.py) on a real
channel, each end with a peer that writes raw msgpack: a message that does not decode, or of a
kind no one knows, fails loudly and only the request it concerns (its first field, the request
id); the other requests are answered and the channel goes on."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from pier.contract.errors import PierError
from pier.contract.types import InferenceRequest, InferenceResponse, Tensor
from pier.frontends.guards import RateLimiter
from pier.frontends.workers import messages as fm
from pier.frontends.workers.channel import Channel
from pier.frontends.workers.pool import FrontendPool, _Frontend
from pier.frontends.workers.worker import RemotePlane
from pier.ipc import channel as wire
from pier.settings import Settings


def _request(x: float) -> InferenceRequest:
    return InferenceRequest("m", "", [Tensor("X", "FP32", [1], np.array([x], np.float32))])


def _raw(sock: Any, message: list[Any]) -> None:
    sock.send(msgspec.msgpack.encode(message))


def test_the_frontend_fails_only_the_request_whose_answer_it_cannot_read(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        ours, server = wire.channel_pair()
        plane = RemotePlane()
        plane.channel = Channel(ours, lambda m, s: plane.answer(m, s), plane.fail_all, fm.TO_FRONTEND,
                                plane.unreadable)
        first, second, third = (asyncio.ensure_future(plane.serve(_request(x), lambda r: r)) for x in (1, 2, 3))
        reader = wire.Receiver(server, fm.FROM_FRONTEND)
        asks = []
        while len(asks) < 3:
            await asyncio.sleep(0.01)
            try:
                asks.append(reader.recv(0x40)[0])  # type: ignore[index]
            except BlockingIOError:
                pass
        assert [type(a) for a in asks] == [fm.Infer] * 3
        _raw(server, ["Reply", asks[0].rid, "not a response"])
        _raw(server, ["Replay", asks[1].rid, None])  # a kind nobody knows
        packer = wire.Packer()
        good = wire.response_out(InferenceResponse("m", "1", [Tensor("Y", "FP32", [1], np.ones(1, np.float32))]),
                                 packer)
        wire.send(server, fm.Reply(asks[2].rid, good), packer)
        with pytest.raises(PierError, match="unreadable answer from the server process: unreadable "
                                            "server-to-frontend message 'Reply'"):
            await first
        with pytest.raises(PierError, match="message 'Replay': unknown kind"):
            await second
        answer = await third
        assert answer.outputs[0].data.tolist() == [1.0] and not plane.channel.closed
        plane.channel.close()
        server.close()

    with caplog.at_level(logging.ERROR, logger="pier.frontends"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert "unreadable server-to-frontend message 'Replay': unknown kind" in caplog.text


class _EchoPlane:
    """Stands in for the DataPlane, which is not what this test is about: answers X as Y."""

    async def serve(self, request: InferenceRequest, encode: Any, model: Any = None, protocol: str = "",
                    received_ns: int = 0) -> Any:
        return encode(InferenceResponse(request.model_name, "1", [Tensor("Y", "FP32", [1], request.inputs[0].data)]))


def test_the_server_answers_a_request_it_cannot_read_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        pool = FrontendPool(Settings((Path("."),)), _EchoPlane(), RateLimiter(), {})  # type: ignore[arg-type]
        ours, frontend_end = wire.channel_pair()
        frontend = _Frontend(0, None)  # type: ignore[arg-type]
        frontend.channel = Channel(ours, lambda m, s: pool._message(frontend, m, s), lambda: None,
                                   fm.FROM_FRONTEND, lambda exc: pool._bad(frontend, exc))
        _raw(frontend_end, ["Infer", 7, "http", 0, ["not", "a", "request"]])
        _raw(frontend_end, ["Admit", 8, "m"])  # a field short
        _raw(frontend_end, ["Infr", 10, "http"])  # a kind nobody knows
        packer = wire.Packer()
        wire.send(frontend_end, fm.Infer(9, "http", 0, wire.request_out(_request(4), packer)), packer)
        reader = wire.Receiver(frontend_end, fm.TO_FRONTEND)
        replies: dict[int, Any] = {}
        while len(replies) < 4:
            await asyncio.sleep(0.01)
            try:
                message, mapping = reader.recv(0x40)  # type: ignore[misc]
            except BlockingIOError:
                continue
            replies[message.rid] = wire.response_in(message.response, mapping)
        assert isinstance(replies[7], PierError) and "unreadable frontend-to-server message 'Infer'" in \
            replies[7].message
        assert isinstance(replies[8], PierError) and "message 'Admit'" in replies[8].message
        assert isinstance(replies[10], PierError) and "message 'Infr': unknown kind" in replies[10].message
        assert replies[9].outputs[0].data.tolist() == [4.0]
        frontend.channel.close()
        frontend_end.close()

    with caplog.at_level(logging.ERROR, logger="pier.frontends"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert "frontend process 0: unreadable frontend-to-server message 'Infer'" in caplog.text


def test_an_error_keeps_its_retry_after_across_the_channel() -> None:
    """An overloaded model's refusal (UNAVAILABLE, retry after N s) reaches a frontend process whole,
    so that its 503 carries Retry-After there too; an error without one stays without."""
    from pier.contract.errors import unavailable

    for sent in (unavailable("model 'm' is overloaded", retry_after=3), unavailable("gone")):
        raw = msgspec.msgpack.encode(wire.error_out(sent))
        got = wire.error_in(msgspec.msgpack.decode(raw, type=wire.WireError))
        assert (got.code, got.message, got.retry_after) == (sent.code, sent.message, sent.retry_after)
