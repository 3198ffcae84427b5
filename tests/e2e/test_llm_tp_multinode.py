"""Tensor parallelism across machines, on loopback: `pier serve` is rank 0 of a model with
`tensor_parallel_size: 2`, `nnodes: 2` (one rank here, one expected from another machine), and
`pier tp-worker` is rank 1, a separate process that joins it over TCP (its step channel) and
torch.distributed's env:// rendezvous on 127.0.0.1.

Greedy float32 answers equal the 1-rank model's token for token; `kill -9` of the worker under load
fails that model's requests with a message naming the rank and its address while another model
serves without a failure; the model is UNAVAILABLE saying which rank it waits for, and serves again
once the worker is started again; a worker whose rank 0 goes away (the engine core killed) exits
non-zero saying so; nothing is left behind (processes, listening ports, /dev/shm)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import EXAMPLE_REPO, ROOT, PierProcess, free_port, start_pier
from tests.e2e.test_llm_engine_process import Hammer, _alive, _engine_pids
from tests.e2e.test_llm_tensor_parallel import _generate, _state, _three_running

pytestmark = pytest.mark.llm

pytest.importorskip("transformers")
pytest.importorskip("tritonclient.http")

GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
PROMPTS = ("The quick brown fox", "Once upon a time in a land far")
CONFIG = ('backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "4000000" } }\n'
          'parameters { key: "num_threads" value { string_value: "1" } }\n')
ENV = {"GLOO_SOCKET_IFNAME": "lo"}  # both ends on loopback


def _port_pair() -> int:
    """A free port p with p + 1 free too (the store, then the step channel), below the ephemeral
    range, as the default 29501 is: a worker that connects to 127.0.0.1:p + 1 before rank 0 listens
    there retries, and a retry whose own ephemeral port is p + 1 connects to itself (TCP's
    simultaneous open), which holds the port rank 0 then fails to bind (seen in CI)."""
    return free_port(2)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Worker:
    """`pier tp-worker` as a separate process (another machine's rank, here on loopback)."""

    def __init__(self, port: int, log: Path, rank: int = 1) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pier", "tp-worker", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--rank", str(rank)], stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, **ENV})

    def said(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _start_with(workers: list[Worker], repo: Path, tmp_path: Path) -> PierProcess:
    """The server for `workers` (already waiting for it); if it does not start, they are killed."""
    try:
        return start_pier([repo], log_path=tmp_path / "pier.log", timeout=180, env=ENV)
    except BaseException:
        for w in workers:
            w.kill()
        raise


def _until_ready(base: str, model: str, deadline: float, log: str) -> list[tuple[str, str]]:
    states = []
    while requests.get(f"{base}/v2/models/{model}/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, (states[-3:], log[-3000:])
        states.append(_state(base, model))
        time.sleep(0.1)
    return states


def _repository(tmp_path: Path, name: str, size: int, port: int) -> Path:
    """tp1 (one rank) and `name`, the same weights on `size` ranks over 2 machines (rank 0 at `port`)."""
    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path / "repo"
    build_model(repo / "tp1" / "1", "llama")
    (repo / "tp1" / "config.pbtxt").write_text(CONFIG)
    shutil.copytree(repo / "tp1" / "1", repo / name / "1")
    (repo / name / "config.pbtxt").write_text(
        CONFIG + "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in (
            ("tensor_parallel_size", size), ("nnodes", 2), ("master_addr", "127.0.0.1"), ("master_port", port))))
    return repo


def test_a_rank_from_another_machine(tmp_path: Path) -> None:
    port = _port_pair()
    repo = _repository(tmp_path, "tpm", 2, port)
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    shm_before = set(os.listdir("/dev/shm"))
    workers = [Worker(port, tmp_path / "worker1.log")]  # started first: it waits for rank 0
    server = _start_with(workers, repo, tmp_path)
    base = server.base()
    try:
        for text in PROMPTS:  # the 2-rank model (one rank remote) answers as the 1-rank one
            one, two = _generate(base, "tp1", text, GREEDY), _generate(base, "tpm", text, GREEDY)
            assert one.status_code == two.status_code == 200, (one.text, two.text)
            assert one.json()["text_output"] == two.json()["text_output"]
        reference = _generate(base, "tp1", PROMPTS[0], GREEDY).json()["text_output"]
        hammer = Hammer(server.http_url)  # the other model, the whole time: not one failure allowed

        with ThreadPoolExecutor(3) as pool:  # kill -9 of the worker under load
            futures = _three_running(pool, server, "tpm")
            killed = workers[0].proc.pid
            os.kill(killed, signal.SIGKILL)
            killed_at = time.monotonic()
            answers = [f.result() for f in futures]
        assert time.monotonic() - killed_at < 15
        for r in answers:
            assert r.status_code == 503, r.text
            why = f"tensor-parallel rank 1 of 2 at {socket.gethostname()} (127.0.0.1), pid {killed} disconnected"
            assert why in r.json()["error"], r.text
        deadline = time.monotonic() + 60
        while "waiting for tensor-parallel rank 1 of 2 to join" not in (state := _state(base, "tpm"))[1]:
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        assert state[0] == "UNAVAILABLE" and f"127.0.0.1:{port + 1}" in state[1], state
        assert _generate(base, "tpm", PROMPTS[0], GREEDY).status_code in (404, 503)  # not ready: refused at once

        workers.append(Worker(port, tmp_path / "worker2.log"))  # its pod restarted: the group forms again
        _until_ready(base, "tpm", time.monotonic() + 120, server.log())
        again = _generate(base, "tpm", PROMPTS[0], GREEDY)
        assert again.status_code == 200 and again.json()["text_output"] == reference, again.text

        core = next(p for p in _engine_pids(server.proc.pid) if _alive(p)
                    and f"127.0.0.1:{port + 1}" in _connections(p))  # rank 0: the engine core of tpm
        os.kill(core, signal.SIGKILL)  # rank 0 goes away: the worker exits non-zero, saying so
        assert workers[1].wait() != 0
        assert "rank 0 at 127.0.0.1" in workers[1].said() and "went away" in workers[1].said(), workers[1].said()
        workers.append(Worker(port, tmp_path / "worker3.log"))
        _until_ready(base, "tpm", time.monotonic() + 120, server.log())
        again = _generate(base, "tpm", PROMPTS[0], GREEDY)
        assert again.status_code == 200 and again.json()["text_output"] == reference, again.text
        hammer.stop_and_check()
    finally:
        stop_code = server.stop()
        last = workers[-1]
        try:
            last_code = last.wait(30)  # told to stop by rank 0
        finally:
            for w in workers:
                w.kill()
    assert stop_code == 0, server.log()[-3000:]
    assert last_code == 0, last.said()
    assert not any(_listening(p) for p in (port, port + 1)), "rank 0's store or step channel outlived the server"
    mine = f"pier-tp-{server.proc.pid}-"  # (other servers on this machine may hold theirs meanwhile)
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(mine)], \
        "a shared-memory segment was left behind"


def test_four_ranks_on_two_machines(tmp_path: Path) -> None:
    """tensor_parallel_size 4 on 2 machines: rank 0 and its child rank 1 here, ranks 2 and 3 joining
    as `pier tp-worker`s; a worker that says it is rank 1 (a rank of rank 0's own machine) is refused."""
    port = _port_pair()
    repo = _repository(tmp_path, "tp4", 4, port)
    workers = [Worker(port, tmp_path / f"worker{r}.log", r) for r in (2, 3, 1)]  # all waiting as the group forms
    server = _start_with(workers, repo, tmp_path)
    try:
        stranger = workers[2]
        assert stranger.wait() == 1
        assert "does not take tensor-parallel rank 1 of 4: this group waits for ranks 2..3 on other machines" \
            in stranger.said(), stranger.said()
        for text in PROMPTS:
            one, four = _generate(server.base(), "tp1", text, GREEDY), _generate(server.base(), "tp4", text, GREEDY)
            assert one.status_code == four.status_code == 200, (one.text, four.text)
            assert one.json()["text_output"] == four.json()["text_output"]
    finally:
        stop_code = server.stop()
        try:
            codes = [w.wait(30) for w in workers[:2]]
        finally:
            for w in workers:
                w.kill()
    assert stop_code == 0, server.log()[-3000:]
    assert codes == [0, 0], [w.said() for w in workers]


def _connections(pid: int) -> str:
    """The local addresses pid listens on (ss), to tell tpm's engine core from tp1's."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return "\n".join(line for line in out.splitlines() if f"pid={pid}," in line)
