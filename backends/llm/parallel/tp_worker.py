"""`pier tp-worker`: a tensor-parallel rank on another machine than the server (rank 0).

It needs only rank 0's address, its own rank and read access to the same model files: it connects
to rank 0's step channel (tcp://MASTER_ADDR:MASTER_PORT+1, remote.py), says Hello, and is sent the
engine's typed settings (WorkerInit); it loads its shard, joins the torch.distributed group through
env:// (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK: set here from what it was given and told), then
runs each step's delta it is sent (worker.serve, as the ranks rank 0 starts itself).

Where its settings come from, first found: the flags; MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE;
a LeaderWorkerSet's LWS_LEADER_ADDRESS / LWS_WORKER_INDEX / LWS_GROUP_SIZE (one rank per pod).

It exits 0 when rank 0 stops the group (Shutdown), and non-zero, saying why on stderr, when rank 0
goes away (its connection closes, or its heartbeats stop), refuses it, or never answers: Kubernetes
restarts the pod, and the new worker joins the group rank 0 forms again.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `pier --help` builds this parser: the engine's imports (torch) wait for `run`
    import zmq

    from .messages import WorkerInit

DEFAULT_PORT = 29501  # vLLM's master_port default, as the server's
SEND_TIMEOUT_MS = 5000


class LeaderGone(RuntimeError):
    """Rank 0's connection closed (or its heartbeats stopped)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tp-worker", help="run one tensor-parallel rank of a model served by a server on "
                                         "another machine (rank 0)")
    p.add_argument("--master-addr", help="rank 0's address (default: $MASTER_ADDR, else $LWS_LEADER_ADDRESS)")
    p.add_argument("--master-port", type=int, help=f"rank 0's master_port (default: $MASTER_PORT, else {DEFAULT_PORT});"
                                                   " its step channel is on the next port")
    p.add_argument("--rank", type=int, help="this rank (default: $RANK, else $LWS_WORKER_INDEX)")
    p.add_argument("--model-dir", help="the model's folder on this machine, where it is not at rank 0's path")
    p.add_argument("--connect-timeout", type=float, default=600.0,
                   help="seconds to wait for rank 0's settings before exiting non-zero (default 600)")


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, int, int, int | None]:
    """(master address, master port, rank, world size or None); ValueError naming what is missing."""
    addr = args.master_addr or env.get("MASTER_ADDR") or env.get("LWS_LEADER_ADDRESS")
    if not addr:
        raise ValueError("no rank 0 address: give --master-addr, or set MASTER_ADDR (or LWS_LEADER_ADDRESS)")
    port_text = args.master_port if args.master_port is not None else env.get("MASTER_PORT", DEFAULT_PORT)
    rank_text = args.rank if args.rank is not None else env.get("RANK", env.get("LWS_WORKER_INDEX"))
    if rank_text is None:
        raise ValueError("no rank: give --rank, or set RANK (or LWS_WORKER_INDEX)")
    size_text = env.get("WORLD_SIZE", env.get("LWS_GROUP_SIZE"))
    try:
        port, rank = int(port_text), int(rank_text)
        size = None if size_text is None else int(size_text)
    except ValueError:
        raise ValueError(f"master port {port_text!r}, rank {rank_text!r} and world size {size_text!r} must be "
                         "integers") from None
    if rank < 1:
        raise ValueError(f"rank {rank}: rank 0 is the server itself; a worker is rank 1 or above")
    return addr, port, rank, size


def run(args: argparse.Namespace) -> int:
    import msgspec
    import zmq

    from pier.ipc.messages import encode

    from .messages import Hello
    from .remote import heartbeats

    try:
        addr, port, rank, size = resolve(args, os.environ)
    except ValueError as exc:
        print(f"pier tp-worker: {exc}", file=sys.stderr)
        return 2
    where = f"{addr}:{port + 1}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    heartbeats(sock)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://{addr}:{port + 1}")
    try:
        sock.send(encode(Hello(rank, socket.gethostname(), os.getpid())))
        init = _first(sock, monitor, where, args.connect_timeout)
        if isinstance(init, str):
            print(f"pier tp-worker: rank {rank}: {init}", file=sys.stderr)
            return 1
        if size is not None and size != init.size:
            print(f"pier tp-worker: rank {rank}: WORLD_SIZE {size} here, but rank 0 at {where} forms a group of "
                  f"{init.size} (tensor_parallel_size)", file=sys.stderr)
            return 1
        if args.model_dir:
            init = msgspec.structs.replace(init, model_dir=args.model_dir)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(init.size), RANK=str(rank))
        print(f"pier tp-worker: rank {rank} of {init.size} joins rank 0 at {where}, model {init.model_dir}",
              file=sys.stderr, flush=True)
        from .worker import serve

        try:
            return serve(init, sock, sock, _receiver(sock, monitor, where))
        except Exception as exc:  # noqa: BLE001 - said, and the exit code says it for Kubernetes
            print(f"pier tp-worker: rank {rank}: {exc}", file=sys.stderr)
            return 1
    finally:
        monitor.close(linger=0)
        sock.close(linger=500)
        ctx.term()


def _gone(where: str) -> str:
    return f"rank 0 at {where} went away (its connection closed): exiting for the group to form again"


def _first(sock: zmq.Socket, monitor: zmq.Socket, where: str, timeout_s: float) -> WorkerInit | str:
    """Rank 0's WorkerInit, or why not (refused, gone, silent)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from .messages import TO_WORKER, Unwelcome, WorkerInit
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    ready = dict(poller.poll(int(timeout_s * 1000)))
    if monitor in ready and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
        return _gone(where)
    if sock not in ready:
        return f"no answer from rank 0 at {where} within {timeout_s:g} s"
    msg = TO_WORKER.decode(sock.recv())
    if isinstance(msg, Unwelcome):
        return msg.message
    if not isinstance(msg, WorkerInit):
        return f"rank 0 at {where} sent {type(msg).__name__} before WorkerInit"
    return msg


def _receiver(sock: zmq.Socket, monitor: zmq.Socket, where: str) -> Callable[[], bytes]:
    """The next message from rank 0; LeaderGone once its connection closes."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)

    def recv() -> bytes:
        while True:
            ready = dict(poller.poll())
            if sock in ready:
                return sock.recv()  # type: ignore[no-any-return]
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                raise LeaderGone(_gone(where))

    return recv
