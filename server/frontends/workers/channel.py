"""The channel between the server process and one frontend process, on the event loops of both.

One `socketpair(AF_UNIX, SOCK_SEQPACKET)` per frontend, the same transport as the Python
backend's stubs (`pier.ipc.channel`): each send is one whole message, tensors over 64 KiB travel
in a memfd the receiver maps (the core's backends read the frontend's tensors in place, the
frontend encodes the outputs from the core's pages). Both ends are non-blocking and read by the
loop itself (`add_reader`): no thread between a request and its scheduler. The messages:
messages.py; a message that does not decode goes to `on_bad` (pier.ipc.messages.BadMessage,
which names what it concerns), and the channel reads on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Callable
from typing import Any

from pier.ipc import channel as wire
from pier.ipc.messages import BadMessage, Codec

log = logging.getLogger("pier.frontends")

OnMessage = Callable[[Any, wire.Source], None]
OnFailure = Callable[[OSError], None]


def _log_bad(exc: BadMessage) -> None:
    log.error("frontend channel: %s", exc)


class Channel:
    """One end, driven by the running loop: `on_message` for each message (the protocol's typed
    Messages with `codec`, plain msgpack values without), `on_bad` for one that does not decode,
    `on_closed` once when the peer is gone (end-of-file, or an error on the socket)."""

    def __init__(self, sock: socket.socket, on_message: OnMessage, on_closed: Callable[[], None],
                 codec: Codec[Any] | None = None, on_bad: Callable[[BadMessage], None] = _log_bad) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._receiver = wire.Receiver(sock, codec)
        self._on_message = on_message
        self._on_bad = on_bad
        self._on_closed = on_closed
        self._loop = asyncio.get_running_loop()
        self._backlog: collections.deque[tuple[bytes, wire.Packer | None, OnFailure | None]] = collections.deque()
        self.closed = False
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self, limit: int = 256) -> None:
        for _ in range(limit):  # then let the loop run what these messages started
            try:
                got = self._receiver.recv()
            except (BlockingIOError, InterruptedError):
                return
            except BadMessage as exc:
                self._on_bad(exc)
                continue
            except OSError as exc:
                log.debug("frontend channel: %s", exc)
                got = None
            if got is None:
                self.close()
                return
            try:
                self._on_message(*got)
            except Exception:  # one bad message must not stop the channel
                log.exception("frontend channel: a message failed")

    def drain(self) -> None:
        """Read every message there is now (when the peer is gone: what it sent before still
        counts; the channel then closes at the end-of-file after them)."""
        if not self.closed:
            self._readable(1 << 30)

    def send(self, message: Any, packer: wire.Packer | None = None,
             on_failure: OnFailure | None = None) -> None:
        """Send now, or after the messages before it when the socket's buffer is full; a closed
        channel drops it (its peer is gone, so is whatever would read it). Raises what the message
        cannot carry (TypeError, msgspec.EncodeError) and an OSError other than the peer's going
        away, so that the caller can answer with an error instead; `on_failure` hears of such an
        OSError when the message waited in the backlog (its memfd could not be made or passed)."""
        if self.closed:
            return
        header = wire.encode(message)
        if not self._backlog:
            try:
                wire.send_encoded(self.sock, header, packer)
                return
            except (BlockingIOError, InterruptedError):
                self._loop.add_writer(self.sock.fileno(), self._writable)
            except (BrokenPipeError, ConnectionResetError):
                self.close()
                return
        self._backlog.append((header, packer, on_failure))

    def _writable(self) -> None:
        while self._backlog:
            header, packer, on_failure = self._backlog[0]
            try:
                wire.send_encoded(self.sock, header, packer)
            except (BlockingIOError, InterruptedError):
                return
            except (BrokenPipeError, ConnectionResetError):
                self.close()
                return
            except OSError as exc:  # this message only (a memfd the kernel would not give, say)
                self._backlog.popleft()
                log.error("frontend channel: a message could not be sent: %s", exc)
                if on_failure is not None:
                    on_failure(exc)
                continue
            self._backlog.popleft()
        self._loop.remove_writer(self.sock.fileno())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._backlog.clear()
        try:
            self._loop.remove_reader(self.sock.fileno())
            self._loop.remove_writer(self.sock.fileno())
        except (ValueError, OSError):  # pragma: no cover - the socket is gone already
            pass
        self.sock.close()
        self._on_closed()
