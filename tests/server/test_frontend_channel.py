"""The channel between the server and a frontend process (pier.frontends.workers.channel), both
ends on one event loop over a real SOCK_SEQPACKET socketpair: messages arrive whole and in order
when the socket's buffer fills (the backlog), large tensors cross in a memfd, a message that
cannot be encoded fails its sender and not the channel, and a peer that goes away closes it once."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pier.contract.types import Tensor
from pier.frontends.workers.channel import Channel
from pier.ipc import channel as wire


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


FILLER = b"x" * 60_000


def _fill(channel: Channel) -> int:
    """Send numbered messages until the socket's buffer is full (the last one waits in the
    backlog); returns how many were sent."""
    sent = 0
    while not channel._backlog:
        channel.send([7, sent, FILLER])
        sent += 1
    return sent


async def _read_until(reader: wire.Receiver, got: list[Any], done: Callable[[], bool]) -> None:
    """Read by hand (the socket non-blocking) while the loop writes the backlog, each message into
    `got`, until `done()`."""
    reader.sock.setblocking(False)
    while not done():
        await asyncio.sleep(0.001)
        try:
            while True:
                message, _ = reader.recv()  # type: ignore[misc]
                got.append(message)
        except BlockingIOError:
            pass


def test_a_full_buffer_keeps_every_message_whole_and_in_order() -> None:
    async def main() -> None:
        a, b = wire.channel_pair()
        sender = _End(a)
        reader = wire.Receiver(b)  # read by hand, so the test decides when the buffer has room
        sent = _fill(sender.channel)
        for _ in range(20):  # after the backlog: still queued
            sender.channel.send([7, sent, FILLER])
            sent += 1
        got: list[Any] = []
        for _ in range(3):  # room in the buffer again, the backlog not yet written
            message, _ = reader.recv()  # type: ignore[misc]
            got.append(message)
        sender.channel.send([7, sent, FILLER])  # must wait behind the backlog, not jump it
        sent += 1
        await _read_until(reader, got, lambda: len(got) >= sent)
        assert all(m[2] == FILLER for m in got)
        assert [m[1] for m in got] == list(range(sent)) and not sender.channel._backlog
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
        sent = _fill(sender.channel)
        failures: list[OSError] = []
        monkeypatch.setattr(ch.wire, "send_encoded", refusing)
        sender.channel.send([7, "refused"], None, failures.append)
        sender.channel.send([7, "after"])
        got: list[Any] = []
        await _read_until(reader, got, lambda: bool(got) and got[-1][1] == "after")
        assert [m[1] for m in got] == [*range(sent), "after"]
        assert len(failures) == 1 and failures[0].errno == errno.ENOMEM
        sender.channel.close()
        b.close()

    _run(main())
