"""The channel between the server process and one frontend process, on the event loops of both.

One `socketpair(AF_UNIX, SOCK_SEQPACKET)` per frontend, the same transport and message layout as
the Python backend's stubs (`pier.contract.wire`): each send is one whole message, tensors over
64 KiB travel in a memfd the receiver maps (the core's backends read the frontend's tensors in
place, the frontend encodes the outputs from the core's pages). Both ends are non-blocking and
read by the loop itself (`add_reader`): no thread between a request and its scheduler.

Messages (msgpack lists, the first item their kind):

    frontend -> server   INFER rid protocol received_ns client_key request
                         CANCEL rid                       (its client went away)
                         READY                            (both ports bound)
                         FAILED message                   (it could not start)
    server -> frontend   SETTINGS pickled-Settings socket-paths
                         REPLY rid response|error
                         LIMITED rid wait scope           (a rate limit refused it)
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

from pier.contract import wire

log = logging.getLogger("pier.frontends")

INFER, CANCEL, READY, FAILED = 1, 2, 3, 4
SETTINGS, REPLY, LIMITED, EXITING, STOP, LOG = 11, 12, 13, 14, 15, 16

OnMessage = Callable[[list[Any], wire.Source], None]


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
        self._backlog: collections.deque[tuple[list[Any], wire.Packer | None]] = collections.deque()
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

    def send(self, message: list[Any], packer: wire.Packer | None = None) -> None:
        """Send now, or after the messages before it when the socket's buffer is full; a closed
        channel drops it (its peer is gone, so is whatever would read it)."""
        if self.closed:
            return
        if not self._backlog:
            try:
                wire.send(self.sock, message, packer)
                return
            except (BlockingIOError, InterruptedError):
                self._loop.add_writer(self.sock.fileno(), self._writable)
            except OSError:
                self.close()
                return
        self._backlog.append((message, packer))

    def _writable(self) -> None:
        while self._backlog:
            message, packer = self._backlog[0]
            try:
                wire.send(self.sock, message, packer)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
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
