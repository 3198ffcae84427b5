"""Rank 0's side of the ranks on other machines: each a `pier tp-worker` (tp_worker.py) that connects
to rank 0's step channel, a ZeroMQ ROUTER on tcp://master_addr:(master_port + 1).

Rank 0 cannot start or restart a process on another machine (Kubernetes does: one rank per pod), so
it waits for them: a worker says Hello (its rank), rank 0 answers WorkerInit (the typed settings its
shard is built from, the folder of the model files it reads), the worker loads and says WorkerReady,
then joins the torch.distributed group through env:// (MASTER_ADDR/MASTER_PORT, the store rank 0
hosts on master_port). Each step's delta then goes to every remote rank on the ROUTER.

A remote rank that dies or whose machine goes away is seen from its connection (the ROUTER's
monitor: its TCP connection closed, or ZeroMQ's heartbeats unanswered; the connection's file
descriptor, which each message carries, tells which rank it was), and `lost` names
it with its address; the engine core fails what is in flight and exits, the server restarts it, and
the new group waits for the rank to join again. The socket is used by the engine's thread (steps)
and this module's thread (what the workers say) under one lock.
"""

from __future__ import annotations

import ipaddress
import logging
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from pier.contract.backend import LoadProgress
from pier.ipc.messages import BadMessage, encode

from .messages import FROM_WORKER, Hello, Shutdown, Unwelcome, WorkerFailed, WorkerInit, WorkerReady

log = logging.getLogger("pier.llm")

HEARTBEAT_MS = 1000  # ZeroMQ's heartbeats: a machine gone without closing its connections is seen...
HEARTBEAT_TIMEOUT_MS = 10_000  # ...after this long without an answer
PROGRESS_EVERY_S = 2.0


def heartbeats(sock: zmq.Socket) -> None:
    """The heartbeat options both ends of a step channel set."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)


def channel_bind(master_addr: str, master_port: int) -> str:
    """Where rank 0 binds its step channel: master_addr where it is an IP address (a test's 127.0.0.1),
    every interface where it is a name (a Kubernetes service's DNS name resolves to this pod)."""
    try:
        ipaddress.ip_address(master_addr)
        host = master_addr if ":" not in master_addr else f"[{master_addr}]"
    except ValueError:
        host = "*"
    return f"tcp://{host}:{master_port + 1}"


@dataclass
class _Peer:
    rank: int
    where: str  # "host (address), pid N": how messages name it
    fd: int  # its connection's
    num_blocks: int | None = None
    said: str = ""


class RemoteRanks:
    """Ranks `ranks` of `size`, on other machines. `make_init(rank)` is what a joining one is sent;
    `lost(reason)` is called (from this module's thread) when one serving goes away."""

    def __init__(self, ctx: zmq.Context, ranks: range, size: int, master_addr: str, master_port: int,
                 make_init: Callable[[int], WorkerInit], lost: Callable[[str], None]) -> None:
        self.ranks, self.size, self.make_init, self._lost = ranks, size, make_init, lost
        self.address = f"{master_addr}:{master_port + 1}"
        self.sock = ctx.socket(zmq.ROUTER)
        heartbeats(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer gone fails (and is dropped)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.sock.bind(channel_bind(master_addr, master_port))
        self.peers: dict[bytes, _Peer] = {}  # routing id -> the rank it joined as
        self.serving = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="llm-tp-remote", daemon=True)
        self._thread.start()

    # -- the engine's thread ----------------------------------------------------------------------

    def missing(self) -> list[int]:
        ready = {p.rank for p in self.peers.values() if p.num_blocks is not None}
        return [r for r in self.ranks if r not in ready]

    def wait(self, timeout_s: float, progress: Callable[[LoadProgress], None] | None) -> dict[int, int]:
        """Until every remote rank has loaded its shard: {rank: its KV blocks}. RuntimeError naming the
        ranks missing after `timeout_s`, or the one that failed its load."""
        deadline = time.monotonic() + timeout_s
        said = 0.0
        with self._changed:
            while True:
                if self.error is not None:
                    raise self.error
                missing = self.missing()
                if not missing:
                    self.serving = True
                    return {p.rank: p.num_blocks for p in self.peers.values() if p.num_blocks is not None}
                now = time.monotonic()
                if now >= deadline:
                    raise RuntimeError(f"{self._waiting(missing)}: none joined within {timeout_s:g} s "
                                       f"(distributed_timeout_seconds); start `pier tp-worker` for each")
                if progress is not None and now >= said:
                    said = now + PROGRESS_EVERY_S
                    progress(LoadProgress(self._waiting(missing), len(self.ranks) - len(missing), len(self.ranks),
                                          unit="remote ranks"))
                self._changed.wait(min(deadline - now, PROGRESS_EVERY_S))

    def _waiting(self, missing: list[int]) -> str:
        which = ", ".join(map(str, missing))
        return f"waiting for tensor-parallel rank{'s' if len(missing) > 1 else ''} {which} of {self.size} " \
               f"to join at {self.address}"

    def send(self, data: bytes) -> None:
        with self._lock:
            for peer in list(self.peers):
                self._send(peer, data)

    def _send(self, peer: bytes, data: bytes) -> None:
        try:
            self.sock.send_multipart([peer, data], copy=False)
        except zmq.ZMQError:  # it is gone: its disconnect notice says so
            pass

    def close(self) -> None:
        """Tell every remote rank to stop (it exits; Kubernetes starts it again, to join the next group)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in self.peers:
                self._send(peer, encode(Shutdown()))
        self._thread.join()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=500)

    # -- this module's thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        fds = [self.sock.getsockopt(zmq.FD), self.monitor.getsockopt(zmq.FD)]
        while True:
            select.select(fds, [], [], 0.1)  # edge-triggered: every wake drains, and the timeout re-checks
            with self._changed:
                if self._closed:
                    return
                while self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # first: a closed fd may be reused
                    event = recv_monitor_message(self.monitor)
                    self._closed_fd(int(event["value"]))
                while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames = self.sock.recv_multipart(copy=False)
                    self._on(frames[0].bytes, frames[-1])
                self._changed.notify_all()

    def _closed_fd(self, fd: int) -> None:
        """A connection closed (or a new one took the number of one that did)."""
        for peer, known in list(self.peers.items()):
            if known.fd == fd:
                del self.peers[peer]
                self._gone(known, "disconnected")

    def _on(self, peer: bytes, frame: zmq.Frame) -> None:
        data = frame.bytes
        known = self.peers.get(peer)
        try:
            msg = FROM_WORKER.decode(data)
        except BadMessage as exc:
            log.error("tensor-parallel step channel at %s: %s", self.address, exc)
            return
        if isinstance(msg, Hello):
            self._hello(peer, msg, frame)
        elif known is None:
            return
        elif isinstance(msg, WorkerReady):
            known.num_blocks = msg.num_blocks
            log.info("tensor-parallel rank %d of %d joined from %s", known.rank, self.size, known.where)
        elif isinstance(msg, WorkerFailed):
            known.said = f"{msg.kind}: {msg.message}"
            if not self.serving:
                message = f"tensor-parallel rank {known.rank} ({known.where}): {msg.message}"
                self.error = ValueError(message) if msg.kind in ("ValueError", "KeyError") else \
                    RuntimeError(f"{msg.kind}: {message}")

    def _hello(self, peer: bytes, msg: Hello, frame: zmq.Frame) -> None:
        taken = {p.rank for p in self.peers.values()}
        if msg.rank not in self.ranks or msg.rank in taken or self.serving:
            why = ("it is already in the group" if msg.rank in taken or self.serving and msg.rank in self.ranks
                   else f"this group waits for ranks {self.ranks.start}..{self.ranks.stop - 1} on other machines")
            self._send(peer, encode(Unwelcome(f"rank 0 at {self.address} does not take tensor-parallel rank "
                                              f"{msg.rank} of {self.size}: {why}")))
            return
        try:
            address = frame.get("Peer-Address")
        except zmq.ZMQError:
            address = "?"
        self.peers[peer] = _Peer(msg.rank, f"{msg.host} ({address}), pid {msg.pid}", int(frame.get(zmq.SRCFD)))
        self._send(peer, encode(self.make_init(msg.rank)))

    def _gone(self, peer: _Peer, how: str) -> None:
        said = f" after {peer.said}" if peer.said else ""
        reason = f"tensor-parallel rank {peer.rank} of {self.size} at {peer.where} {how}{said}"
        if self.serving:
            self._lost(reason)
        else:  # before the group formed: it may join again; the wait goes on
            log.warning("%s while the group formed", reason)
