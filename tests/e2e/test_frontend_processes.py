"""`--frontend-processes N` under a real `pier serve`: N worker processes share the HTTP and gRPC
ports; a `kill -9` of one under load costs only the connections it held (the others serve, the
server restarts it); rate limits count every frontend's requests; large tensors cross through
shared memory both ways; a port already taken fails the start with its reason; shutdown leaves
no process, socket folder or /dev/shm entry behind. (The e2e tests marked `frontends` run in this
mode too: `make test` runs them again with PIER_TEST_FRONTEND_PROCESSES=2.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.conftest import EXAMPLE_REPO, PierProcess, free_port, start_pier

pytestmark = pytest.mark.frontends  # sets --frontend-processes itself: make test's first pass runs it so

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

WORKER = "pier.frontends.workers.worker"


def frontends(server_pid: int) -> list[int]:
    """The live frontend processes of a server (its children running the worker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(") ", 1)[1].split()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if stat[0] != "Z" and int(stat[1]) == server_pid and any(WORKER.encode() in a for a in argv):
            found.append(int(entry))
    return sorted(found)


def _socket_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("pier-frontends-*")}


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _until(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _infer_once(base: str) -> int:
    """One identity request on a new connection (so the kernel picks a frontend for it)."""
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    r = requests.post(f"{base}/v2/models/identity_fp32/infer", json=body, timeout=10,
                      headers={"Connection": "close"})
    assert r.status_code != 200 or r.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0, 4.0]
    return r.status_code


@pytest.fixture
def server(tmp_path: Path):
    before = (_socket_dirs(), _shm())
    s = start_pier([EXAMPLE_REPO], "--frontend-processes=2", log_path=tmp_path / "pier.log")
    yield s, before
    s.stop()


def _stopped_clean(s: PierProcess, before: tuple[set[str], set[str]]) -> None:
    pid = s.proc.pid
    assert s.stop() == 0, s.log()[-3000:]
    _until(lambda: not frontends(pid), "the frontend processes to exit", timeout=5)
    assert _socket_dirs() <= before[0], _socket_dirs() - before[0]
    assert _shm() <= before[1], _shm() - before[1]


@pytest.mark.slow
def test_kill_9_of_a_frontend_costs_only_its_connections(server) -> None:
    s, before = server
    first = frontends(s.proc.pid)
    assert len(first) == 2, first
    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                code = _infer_once(s.base())
                if code == 200:
                    served[0] += 1
                else:
                    failures.append(f"HTTP {code}")
            except requests.ConnectionError as exc:  # a connection the killed process held or had queued
                failures.append(f"connection: {exc}")

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victim = first[0]
    os.kill(victim, 9)
    time.sleep(0.5)
    at_kill = len(failures)
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join()
    assert served[0] > 50, served
    # Only connections already on the killed process can fail; every later request is served.
    assert len(failures) == at_kill and at_kill <= 8, failures
    assert all(f.startswith("connection") for f in failures), failures
    _until(lambda: len(frontends(s.proc.pid)) == 2 and victim not in frontends(s.proc.pid), "the restart")
    assert f"(pid {victim}) killed by signal 9 (SIGKILL): restarting it" in s.log()
    # The control plane and gRPC answer through the restarted set too.
    client = grpcclient.InferenceServerClient(s.grpc_url)
    assert client.is_model_ready("identity_fp32")
    assert requests.get(f"{s.base()}/v2/models/stats", timeout=10).json()["model_stats"]
    _stopped_clean(s, before)


def test_large_tensors_cross_both_ways_through_shared_memory(server) -> None:
    s, before = server
    x = np.random.default_rng(0).random((1, 1 << 20), dtype=np.float32)  # 4 MiB: a memfd each way
    http = httpclient.InferenceServerClient(s.http_url)
    grpc = grpcclient.InferenceServerClient(s.grpc_url)
    for mod, client in ((httpclient, http), (grpcclient, grpc)):
        inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0")
        assert np.array_equal(out, x)
    words = np.array([["ä" * 1000] * 100], dtype=object)  # BYTES inline, 200 KB of text
    inp = httpclient.InferInput("INPUT0", [1, 100], "BYTES")
    inp.set_data_from_numpy(words)
    # the example repository's identity is FP32: the server refuses BYTES, through the frontend
    with pytest.raises(Exception, match="INPUT0"):
        http.infer("identity_fp32", [inp])
    _stopped_clean(s, before)


def test_rate_limits_count_every_frontends_requests(tmp_path: Path) -> None:
    s = start_pier([EXAMPLE_REPO], "--frontend-processes=2", "--rate-limit-model=identity_fp32=2:4",
                   log_path=tmp_path / "pier.log")
    try:
        began = time.monotonic()
        codes = [_infer_once(s.base()) for _ in range(30)]
        elapsed = time.monotonic() - began
        # A burst of 4 and 2/s after it, whichever frontend took each connection (two limiters of
        # their own would admit twice that).
        assert 4 <= codes.count(200) <= 4 + 2 * elapsed + 1, (codes, elapsed)
        assert set(codes) == {200, 429}, codes
        r = requests.post(f"{s.base()}/v2/models/identity_fp32/infer", timeout=10, json={
            "inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]})
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and "rate limit exceeded for model 'identity_fp32'" in r.text
        client = grpcclient.InferenceServerClient(s.grpc_url)
        inp = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
        inp.set_data_from_numpy(np.ones((1, 1), np.float32))
        refused = 0
        for _ in range(10):
            try:
                client.infer("identity_fp32", [inp])
            except Exception as exc:  # InferenceServerException
                assert "rate limit exceeded" in str(exc)
                refused += 1
        assert refused >= 5
        metrics = requests.get(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).text
        assert 'pier_rate_limited_requests_total{model="identity_fp32",scope="model"}' in metrics
    finally:
        assert s.stop() == 0


def test_a_rate_limit_meets_a_request_before_its_body_and_counts_it_once(tmp_path: Path) -> None:
    """The frontend asks the server's limiter before it reads the body (a throttled client's body,
    malformed or not, gets 429, as with one process), and a request it relays whole after all
    (its input is in shared memory, which the server holds) is counted once, not twice."""
    import tritonclient.utils.shared_memory as shm

    s = start_pier([EXAMPLE_REPO], "--frontend-processes=2", "--rate-limit-model=identity_fp32=0.01:4",
                   log_path=tmp_path / "pier.log")
    key = f"/pier_test_{os.getpid()}_limits"
    handle = shm.create_shared_memory_region(key, key, 16)
    try:
        client = httpclient.InferenceServerClient(s.http_url)
        client.register_system_shared_memory("in", key, 16)
        shm.set_shared_memory_region(handle, [np.arange(4, dtype=np.float32).reshape(1, 4)])
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_shared_memory("in", 16)
        for _ in range(4):  # the burst: each relayed request takes one token
            out = client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32).reshape(1, 4))
        r = requests.post(f"{s.base()}/v2/models/identity_fp32/infer", data=b"{not json", timeout=10)
        assert r.status_code == 429 and "rate limit exceeded for model 'identity_fp32'" in r.text, r.text
        assert int(r.headers["Retry-After"]) >= 1
        g = grpcclient.InferenceServerClient(s.grpc_url)
        ginp = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
        ginp.set_data_from_numpy(np.ones((1, 1), np.float32))
        with pytest.raises(Exception, match="rate limit exceeded"):
            g.infer("identity_fp32", [ginp])
        client.unregister_system_shared_memory("in")
    finally:
        shm.destroy_shared_memory_region(handle)
        assert s.stop() == 0


def _serve_on_http_port(port: int, frontends: int) -> subprocess.CompletedProcess:
    """`pier serve` with frontend processes on a given HTTP port (expected to fail: it returns)."""
    return subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={EXAMPLE_REPO}",
                           f"--frontend-processes={frontends}", "--http-address=127.0.0.1", f"--http-port={port}",
                           "--grpc-address=127.0.0.1", f"--grpc-port={free_port()}",
                           "--metrics-address=127.0.0.1", f"--metrics-port={free_port()}"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_a_port_another_reuseport_server_holds_is_refused(tmp_path: Path) -> None:
    """The frontends bind with SO_REUSEPORT; a second server on the same ports must not join the
    first one's (the kernel would split the clients between them): it fails as one process would."""
    first = start_pier([EXAMPLE_REPO], "--frontend-processes=1", log_path=tmp_path / "first.log")
    try:
        proc = _serve_on_http_port(first.http_port, frontends=1)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert f"cannot bind HTTP to 127.0.0.1:{first.http_port}" in proc.stderr, proc.stderr[-2000:]
        assert _infer_once(first.base()) == 200
    finally:
        assert first.stop() == 0


def test_a_port_in_use_fails_the_start_with_its_reason(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        before = _socket_dirs()
        proc = _serve_on_http_port(port, frontends=2)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "failed to start" in proc.stderr and str(port) in proc.stderr, proc.stderr[-2000:]
        assert _socket_dirs() <= before
    finally:
        taken.close()


def test_bad_process_count_is_refused() -> None:
    proc = subprocess.run([sys.executable, "-m", "pier", "serve", "--model-repository=x", "--frontend-processes=-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid process count: '-1'" in proc.stderr, proc.stderr
