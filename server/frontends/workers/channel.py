"""The channel between the server process and one frontend process, on the event loops of both.

One `socketpair(AF_UNIX, SOCK_SEQPACKET)` per frontend, the same transport and message layout as
the Python backend's stubs (`pier.ipc.channel`): each send is one whole message, tensors over
64 KiB travel in a memfd the receiver maps (the core's backends read the frontend's tensors in
place, the frontend encodes the outputs from the core's pages). Both ends are non-blocking and
read by the loop itself (`add_reader`): no thread between a request and its scheduler.

Messages (msgpack lists, the first item their kind):

    frontend -> server   ADMIT rid model client_key       (the rate limits, before the body is read)
                         INFER rid protocol received_ns request
                         REFUND model client_key          (admitted, then relayed: the server admits it)
                         CANCEL rid                       (its client went away)
                         READY                            (both ports bound)
                         FAILED message                   (it could not start)
    server -> frontend   SETTINGS pickled-Settings socket-paths
                         ADMITTED rid None|[wait, scope] (None: go on; else a rate limit refused it)
                         REPLY rid response|error
                         EXITING                          (the server drains: Connection: close)
                         STOP                             (close the ports and exit)
                         LOG settings                     (the logging extension changed them)
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Callable
from typing import Any

from pier.ipc import channel as wire

log = logging.getLogger("pier.frontends")

INFER, CANCEL, READY, FAILED, ADMIT, REFUND = 1, 2, 3, 4, 5, 6
SETTINGS, REPLY, ADMITTED, EXITING, STOP, LOG = 11, 12, 13, 14, 15, 16

OnMessage = Callable[[list[Any], wire.Source], None]
OnFailure = Callable[[OSError], None]


class Channel:
    """One end, driven by the running loop: `on_message` for each message, `on_closed` once when
    the peer is gone (end-of-file, or an error on the socket)."""

    def __init__(self, sock: socket.socket, on_message: OnMessage, on_closed: Callable[[], None]) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._receiver = wire.Receiver(sock)
        self._on_message = on_message
        self._on_closed = on_closed
        self._loop = asyncio.get_running_loop()
        self._backlog: collections.deque[tuple[bytes, wire.Packer | None, OnFailure | None]] = collections.deque()
        self.closed = False
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        for _ in range(256):  # then let the loop run what these messages started
            try:
                got = self._receiver.recv()
            except (BlockingIOError, InterruptedError):
                return
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

    def send(self, message: list[Any], packer: wire.Packer | None = None,
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
