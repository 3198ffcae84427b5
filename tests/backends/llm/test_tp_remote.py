"""Ranks on other machines, without a model: the settings (config.pbtxt and `pier tp-worker`'s),
and rank 0's step channel (parallel/remote.py) as a worker meets it over TCP on loopback: a rank it
does not wait for is refused saying why, the ones it waits for are sent their settings, the wait
names the missing ones, and a rank whose connection closes is lost, named with its address."""

from __future__ import annotations

import argparse
import socket
import threading

import pytest
import zmq

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.parallel.messages import TO_WORKER, Hello, Unwelcome, WorkerInit, WorkerReady
from pier.backends.llm.parallel.remote import RemoteRanks
from pier.backends.llm.parallel.tp_worker import resolve
from pier.ipc.messages import encode


def test_the_settings_and_their_checks() -> None:
    cfg = EngineConfig.from_parameters({"tensor_parallel_size": "4", "nnodes": "2", "master_addr": "10.0.0.7",
                                        "master_port": "30000", "distributed_timeout_seconds": "90",
                                        "engine_core": "process"})
    par = cfg.parallel
    assert (par.local_ranks, par.master_addr, par.master_port, par.join_timeout_s) == (2, "10.0.0.7", 30000, 90.0)
    assert EngineConfig().parallel.join_timeout_s == 600.0 and EngineConfig().parallel.nnodes == 1
    for bad, words in (({"tensor_parallel_size": "2", "nnodes": "3"}, "nnodes (3) must be at least 1 and divide"),
                       ({"master_port": "65535"}, "master_port must be between 1 and 65534"),
                       ({"distributed_timeout_seconds": "0"}, "distributed_timeout_seconds must be at least 1")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            EngineConfig.from_parameters(bad)


def _args(**given: object) -> argparse.Namespace:
    return argparse.Namespace(**{"master_addr": None, "master_port": None, "rank": None, **given})


def test_a_worker_takes_flags_then_torchs_variables_then_a_leaderworkersets() -> None:
    lws = {"LWS_LEADER_ADDRESS": "pier-0.pier.ns", "LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"}
    assert resolve(_args(), lws) == ("pier-0.pier.ns", 29501, 1, 2)
    torch_env = {**lws, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "30000", "RANK": "3", "WORLD_SIZE": "4"}
    assert resolve(_args(), torch_env) == ("10.0.0.7", 30000, 3, 4)
    assert resolve(_args(master_addr="h", master_port=1234, rank=2), torch_env) == ("h", 1234, 2, 4)
    with pytest.raises(ValueError, match="no rank 0 address"):
        resolve(_args(rank=1), {})
    with pytest.raises(ValueError, match="no rank: give --rank"):
        resolve(_args(master_addr="h"), {})
    with pytest.raises(ValueError, match="rank 0 is the server itself"):
        resolve(_args(master_addr="h", rank=0), {})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1]) - 1  # the channel is on master_port + 1


def test_rank_0s_step_channel() -> None:
    ctx = zmq.Context()
    port = _free_port()
    lost: list[str] = []
    gone = threading.Event()

    def on_lost(reason: str) -> None:
        lost.append(reason)
        gone.set()

    init = WorkerInit(1, 2, "", 0, "/models/m/1", {}, [2], 64, None, "")
    remote = RemoteRanks(ctx, range(1, 2), 2, "127.0.0.1", port, lambda r: init, on_lost)
    workers = []
    try:
        def worker(rank: int) -> zmq.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.connect(f"tcp://127.0.0.1:{port + 1}")
            sock.send(encode(Hello(rank, "box", 4242)))
            workers.append(sock)
            return sock

        stranger = worker(3)
        answer = TO_WORKER.decode(stranger.recv())
        assert isinstance(answer, Unwelcome)
        assert answer.message == (f"rank 0 at 127.0.0.1:{port + 1} does not take tensor-parallel rank 3 of 2: "
                                  "this group waits for ranks 1..1 on other machines")
        with pytest.raises(RuntimeError, match=f"waiting for tensor-parallel rank 1 of 2 to join at 127.0.0.1:"
                                               f"{port + 1}: none joined within 0.2 s"):
            remote.wait(0.2, None)
        rank1 = worker(1)
        assert TO_WORKER.decode(rank1.recv()) == init
        rank1.send(encode(WorkerReady(1, 77)))
        assert remote.wait(10, None) == {1: 77}
        again = worker(1)  # a second rank 1 while the group serves
        assert "it is already in the group" in TO_WORKER.decode(again.recv()).message  # type: ignore[union-attr]
        assert not lost
        rank1.close(linger=0)  # its process died: its connection closes
        assert gone.wait(10), "the lost rank was not seen"
        assert lost == ["tensor-parallel rank 1 of 2 at box (127.0.0.1), pid 4242 disconnected"]
    finally:
        for sock in workers:
            sock.close(linger=0)
        remote.close()
        ctx.term()
