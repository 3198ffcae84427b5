"""One restart budget for every kind of child (pier.ipc.supervisor), under a real `pier serve`: a
Python model's stub, the LLM engine core and a frontend process, each `kill -9`ed twice, come
back the first time at once and the second time after the shared backoff (1 s: the second
restart within the window), as their owners' policies say (RestartPolicy: 5 in 600 s, 3 in 600 s,
10 in 60 s); past the budget a child stays down (the stub's, settable, shows it); and when the
server itself is killed, every child goes with it (die_with_parent: no polling, no end-of-file
needed)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from pier.backends.llm import core_client
from pier.backends.python import process
from pier.frontends.workers import pool
from pier.ipc.child import RestartPolicy
from tests.conftest import EXAMPLE_REPO, PierProcess, start_pier

pytestmark = pytest.mark.slow

TICK = os.sysconf("SC_CLK_TCK")
BACKOFF = 1.0  # the second restart within a window waits this long, for every owner

IDENTITY_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
'''
IDENTITY_CONFIG = '''backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
'''


def test_every_owner_uses_the_shared_policy_with_its_own_numbers() -> None:
    """The numbers each owner gives pier.ipc's one RestartPolicy (its docs state them)."""
    assert process.RESTART_BACKOFF_S == core_client.RESTART_BACKOFF_S == pool.RESTART_BACKOFF_S == BACKOFF
    assert (core_client.MAX_RESTARTS, core_client.RESTART_WINDOW_S) == (3, 600.0)
    assert (pool.RESTARTS, pool.RESTART_WINDOW_S) == (10, 60.0)
    assert [RestartPolicy(5, 600, BACKOFF).delay(n) for n in range(8)] == [0, 1, 2, 4, 8, 16, 30, 30]


def _children(pid: int, marker: str) -> list[int]:
    """Live children of `pid` (any of its threads) whose command line names `marker`."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            try:
                state = Path(f"/proc/{kid}/stat").read_text().rsplit(") ", 1)[1][0]
                cmdline = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError):
                continue
            if state != "Z" and marker in cmdline:
                found.append(int(kid))
    return found


def _started_at(pid: int) -> float:
    """When `pid` started, on CLOCK_BOOTTIME (/proc's start time, in clock ticks since boot)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]) / TICK


def _until(check: Callable[[], object], what: str, timeout: float = 90) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_twice(server: PierProcess, marker: str, ready: Callable[[], bool]) -> tuple[list[int], list[float]]:
    """Kill the one child named `marker` twice, each time once it serves; the pids it had and the
    seconds from each kill to the next child's start."""
    pids = [_until(lambda: _children(server.proc.pid, marker), f"a {marker} child")[0]]  # type: ignore[index]
    gaps = []
    for _ in range(2):
        _until(ready, "the child to serve")
        killed_at = time.clock_gettime(time.CLOCK_BOOTTIME)
        os.kill(pids[-1], signal.SIGKILL)
        new = _until(lambda: [p for p in _children(server.proc.pid, marker) if p not in pids], "its restart")
        pids.append(new[0])  # type: ignore[index]
        gaps.append(_started_at(pids[-1]) - killed_at)
    _until(ready, "the child to serve")
    return pids, gaps


def _dies_with_the_server(server: PierProcess, pids: list[int]) -> None:
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    _until(lambda: not any(_alive(p) for p in pids), "the children to die with the server", timeout=10)


def _check_backoff(gaps: list[float]) -> None:
    first, second = gaps
    assert first < BACKOFF - 0.1, gaps  # at once (plus the time to see the death and fork)
    assert BACKOFF - 0.05 <= second < BACKOFF + 3, gaps  # after the backoff (ticks of 10 ms)


def _ready(server: PierProcess, model: str) -> Callable[[], bool]:
    return lambda: requests.get(f"{server.base()}/v2/models/{model}/ready", timeout=10).status_code == 200


def test_a_stub_restarts_at_once_then_after_the_backoff_then_stays_down(tmp_path: Path) -> None:
    (tmp_path / "repo" / "ident_py" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "ident_py" / "1" / "model.py").write_text(IDENTITY_PY)
    (tmp_path / "repo" / "ident_py" / "config.pbtxt").write_text(IDENTITY_CONFIG)
    server = start_pier([tmp_path / "repo"], "--backend-config=python,stub-restart-limit=2",
                        log_path=tmp_path / "pier.log")
    try:
        marker = "pier.backends.python.stub"
        pids, gaps = _kill_twice(server, marker, _ready(server, "ident_py"))
        _check_backoff(gaps)
        assert "died: killed by signal 9 (SIGKILL); restarting in 1 s" in server.log()
        os.kill(pids[-1], signal.SIGKILL)  # the budget (2 restarts here) is spent: it stays down
        _until(lambda: "not restarted: 2 restarts in the last 600 s" in server.log(), "the budget to run out")
        time.sleep(BACKOFF + 1)
        assert not _children(server.proc.pid, marker) and not _ready(server, "ident_py")()
    finally:
        server.stop()


@pytest.mark.llm
def test_the_engine_core_restarts_at_once_then_after_the_backoff(tmp_path: Path) -> None:
    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path / "repo"
    build_model(repo / "tiny_llama" / "1", "llama")
    (repo / "tiny_llama" / "config.pbtxt").write_text(
        'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "8000000" } }\n')
    shutil.copytree(EXAMPLE_REPO / "identity_fp32", repo / "identity_fp32")
    server = start_pier([repo], log_path=tmp_path / "pier.log", timeout=120)
    try:
        marker = "pier.backends.llm.engine_core"
        pids, gaps = _kill_twice(server, marker, _ready(server, "tiny_llama"))
        _check_backoff(gaps)
        # a third death (its restart waits 2 s): meanwhile the OpenAI API says why, not "does not exist"
        os.kill(pids[-1], signal.SIGKILL)
        answers: list[tuple[int, str]] = []

        def refused() -> bool:
            r = requests.post(f"{server.base()}/v1/completions", timeout=30,
                              json={"model": "tiny_llama", "prompt": "x", "max_tokens": 1})
            answers.append((r.status_code, r.text))
            return "is not available now" in r.text

        _until(refused, "a refusal while the engine core restarts", timeout=30)
        assert answers[-1][0] == 503 and "killed by signal 9" in answers[-1][1], answers
        assert not [a for a in answers if a[0] == 404], answers
        pids += _until(lambda: [p for p in _children(server.proc.pid, marker) if p not in pids],  # type: ignore[arg-type]
                       "its restart")
        _dies_with_the_server(server, pids[-1:])
    finally:
        server.stop()


def test_a_frontend_restarts_at_once_then_after_the_backoff(tmp_path: Path) -> None:
    server = start_pier([EXAMPLE_REPO], "--frontend-processes=1", log_path=tmp_path / "pier.log")

    def serves() -> bool:
        try:
            return requests.get(f"{server.base()}/v2/health/ready", timeout=5,
                                headers={"Connection": "close"}).status_code == 200
        except requests.ConnectionError:  # no frontend on the port just now
            return False

    try:
        pids, gaps = _kill_twice(server, "pier.frontends.workers.worker", serves)
        _check_backoff(gaps)
        log = server.log()
        assert f"(pid {pids[0]}) killed by signal 9 (SIGKILL): restarting it" in log
        assert f"(pid {pids[1]}) killed by signal 9 (SIGKILL): restarting it in 1 s" in log
        _dies_with_the_server(server, pids[-1:])
    finally:
        server.stop()
