"""The channel between the server and a frontend process (pier.frontends.workers.channel), both
ends on one event loop over a real SOCK_SEQPACKET socketpair: messages arrive whole and in order
when the socket's buffer fills (the backlog), large tensors cross in a memfd, a message that
cannot be encoded fails its sender and not the channel, and a peer that goes away closes it once."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest

from pier.contract import wire
from pier.contract.types import Tensor
from pier.frontends.workers.channel import Channel


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


class _End:
    def __init__(self, sock: socket.socket) -> None:
        self.got: list[tuple[list[Any], wire.Source]] = []
        self.closed = 0
        self.arrived = asyncio.Event()
        self.channel = Channel(sock, self._message, self._closed)

    def _message(self, message: list[Any], mapping: wire.Source) -> None:
        self.got.append((message, mapping))
        self.arrived.set()

    def _closed(self) -> None:
        self.closed += 1
        self.arrived.set()

    async def until(self, count: int) -> None:
        while len(self.got) < count:
            self.arrived.clear()
            await self.arrived.wait()


def test_a_full_buffer_keeps_every_message_whole_and_in_order() -> None:
    async def main() -> None:
        a, b = wire.channel_pair()
        sender = _End(a)
        reader = wire.Receiver(b)  # read by hand, so the test decides when the buffer has room
        filler = b"x" * 60_000
        sent = 0
        while not sender.channel._backlog:  # until the socket's buffer is full
            sender.channel.send([7, sent, filler])
            sent += 1
        for _ in range(20):  # after the backlog: still queued
            sender.channel.send([7, sent, filler])
            sent += 1
        got = []
        for _ in range(3):  # room in the buffer again, the backlog not yet written
            message, _ = reader.recv()  # type: ignore[misc]
            got.append(message[1])
        sender.channel.send([7, sent, filler])  # must wait behind the backlog, not jump it
        sent += 1
        b.setblocking(False)
        while len(got) < sent:
            await asyncio.sleep(0.001)  # the loop writes the backlog as the buffer drains
            try:
                while True:
                    message, _ = reader.recv()  # type: ignore[misc]
                    assert message[2] == filler
                    got.append(message[1])
            except BlockingIOError:
                pass
        assert got == list(range(sent)) and not sender.channel._backlog
        sender.channel.close()
        b.close()

    _run(main())


def test_large_tensors_cross_in_a_memfd_and_small_ones_inline() -> None:
    async def main() -> None:
        a, b = wire.channel_pair()
        sender, receiver = _End(a), _End(b)
        big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
        small = np.arange(4, dtype=np.int64)
        packer = wire.Packer()
        wired = [wire.tensor_out(Tensor("s", "INT64", [4], small), packer),
                 wire.tensor_out(Tensor("b", "FP32", [1 << 18], big), packer)]
        sender.channel.send([9, wired], packer)
        await receiver.until(1)
        message, mapping = receiver.got[0]
        assert mapping is not None  # the big one is in a memfd the receiver mapped
        got = [wire.tensor_in(t, mapping) for t in message[1]]
        np.testing.assert_array_equal(got[0].data, small)
        np.testing.assert_array_equal(got[1].data, big)
        sender.channel.close()
        receiver.channel.close()

    _run(main())


def test_an_unencodable_message_fails_its_sender_not_the_channel() -> None:
    async def main() -> None:
        a, b = wire.channel_pair()
        sender, receiver = _End(a), _End(b)
        with pytest.raises(TypeError):
            sender.channel.send([7, object()])
        sender.channel.send([7, "after"])
        await receiver.until(1)
        assert receiver.got[0][0] == [7, "after"] and not sender.channel.closed
        sender.channel.close()
        receiver.channel.close()

    _run(main())


def test_a_peer_that_goes_away_closes_the_channel_once() -> None:
    async def main() -> None:
        a, b = wire.channel_pair()
        sender, receiver = _End(a), _End(b)
        receiver.channel.close()
        while not sender.channel.closed:  # end-of-file on its next read
            sender.arrived.clear()
            await sender.arrived.wait()
        sender.channel.send([7, "dropped"])  # a closed channel drops it, raises nothing
        sender.channel.close()
        assert sender.closed == 1 and receiver.closed == 1

    _run(main())


def test_a_queued_message_the_kernel_refuses_reports_to_its_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message that waited in the backlog and then cannot be sent (no memfd to be had, say) is
    reported to its sender's `on_failure`, so that the request behind it fails instead of waiting
    forever; the messages after it still go."""
    import errno

    from pier.frontends.workers import channel as ch

    real = wire.send_encoded

    def refusing(sock: socket.socket, header: bytes, packer: Any = None) -> None:
        if b"refused" in header:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        real(sock, header, packer)

    async def main() -> None:
        a, b = wire.channel_pair()
        sender = _End(a)
        reader = wire.Receiver(b)
        filler = b"x" * 60_000
        sent = 0
        while not sender.channel._backlog:
            sender.channel.send([7, sent, filler])
            sent += 1
        failures: list[OSError] = []
        monkeypatch.setattr(ch.wire, "send_encoded", refusing)
        sender.channel.send([7, "refused"], None, failures.append)
        sender.channel.send([7, "after"])
        b.setblocking(False)
        got: list[Any] = []
        while not got or got[-1] != "after":
            await asyncio.sleep(0.001)
            try:
                while True:
                    message, _ = reader.recv()  # type: ignore[misc]
                    got.append(message[1])
            except BlockingIOError:
                pass
        assert got == [*range(sent), "after"] and len(failures) == 1 and failures[0].errno == errno.ENOMEM
        sender.channel.close()
        b.close()

    _run(main())
