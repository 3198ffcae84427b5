"""Shared fixtures: build model repositories and run the real `pier serve` process on free
loopback ports (tests talk to it with tritonclient, grpc and plain HTTP)."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from scripts.build_example_models import identity_model, write_model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_REPO = ROOT / "model_repository"
# The LLM engine's C++ kernels compile once per checkout, into build/ (make clean removes them): torch
# keys its cache by extension name and rebuilds when the sources' paths change, so checkouts sharing
# ~/.cache/torch_extensions (worktrees, a clean clone beside a dev tree) would rebuild them (~15 s)
# each time the other one ran. Servers and engine-core processes the tests start inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))
# Markers a whole folder carries (pyproject.toml registers them; the others sit on the tests).
FOLDER_MARKERS = {ROOT / "tests" / "e2e": "e2e", ROOT / "tests" / "backends" / "llm": "llm"}
# FRONTENDS: which e2e tests `make test` runs a second time, every server with --frontend-processes=2.
# What differs in that mode (docs/architecture.md "Frontend processes", server/frontends/workers/):
# a frontend process parses, decodes and encodes `POST .../infer` and gRPC ModelInfer itself and
# sends the decoded request over its channel (every datatype, parameter, requested output and
# sequence flag crosses it), checks API keys and restrictions on them, asks the server's rate
# limits (ADMIT) and relays a request it cannot serve after all (shared memory, raw binary,
# compressed); the relay itself (streams, server-sent events, cancellation, deadlines); startup
# (binding, TLS, keepalive, a failed start); the drain and shutdown; the logging settings. So:
# whole modules for those paths (bad input, clients, datatypes, classification, HTTP extras,
# sequences, shared memory, guards, shutdown, logging, tracing, perf_analyzer), single tests
# elsewhere (startup, tritonserver flags, the relay of the LLM's streams, parameters both ways).
# Not again: what the server process does in either mode with the same code (model control,
# repositories, the life cycle and rollouts, batching, backends, ensembles, the LLM engine).

# KServe datatype -> (config type, ONNX identity model available)
ROUND_TRIP_TYPES = ["BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64",
                    "FP16", "FP32", "FP64", "BYTES", "BF16"]


@pytest.hookimpl(tryfirst=True)  # before -m selects on them
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for folder, marker in FOLDER_MARKERS.items():
            if folder in item.path.parents:
                item.add_marker(marker)


def free_port(count: int = 1) -> int:
    """A free loopback port p (p .. p + count - 1 all free) below the ephemeral range: a port there
    is never drawn as an outgoing connection's source port, which could take it between this check
    and the server's bind (seen in CI: "address already in use"), or connect to itself."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(500):
        port = random.randrange(10000, low - count)
        with contextlib.ExitStack() as held:
            try:
                for i in range(count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port + i))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no {count} free port(s) in a row below {low}")


@dataclass
class PierProcess:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def base(self) -> str:
        return f"http://{self.http_url}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        """Until `text` is on the server's log (on two shared cores it may take a while); AssertionError
        with the log after `timeout` s, the server killed (a failed test leaves none behind)."""
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"{text!r} never came on the server's log:\n{self.log()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def private_tmpdir(tmp_path: Path) -> dict[str, str]:
    """A server's own TMPDIR (its scratch folders, which the test checks): `tmp_path/tmp`, given to
    it as a short link in /tmp, since under a path as long as pytest's they would be made in /tmp
    instead (pier.ipc.child.scratch_folder). Other servers on the machine use the shared one."""
    real = tmp_path / "tmp"
    real.mkdir()
    short = Path(tempfile.mkdtemp(prefix="pier-t-", dir="/tmp"))
    (short / "t").symlink_to(real)
    atexit.register(shutil.rmtree, short, True)  # the link (not what it points to), when pytest ends
    return {"TMPDIR": str(short / "t")}


def start_pier(repos: list[Path], *extra: str, log_path: Path, wait_ready: bool = True,
               timeout: float = 60, env: dict[str, str] | None = None,
               ports: tuple[int, int, int] | None = None) -> PierProcess:
    http, grpc_, metrics = ports or (free_port(), free_port(), free_port())
    # PIER_TEST_FRONTEND_PROCESSES=N runs every such server with N frontend processes (`make test`
    # runs the tests marked `frontends` once so, FRONTENDS below): both modes must answer alike.
    frontends = os.environ.get("PIER_TEST_FRONTEND_PROCESSES")
    if frontends and not any(a.startswith("--frontend-processes") for a in extra):
        extra = (*extra, f"--frontend-processes={frontends}")
    cmd = [sys.executable, "-m", "pier", "serve",
           *[f"--model-repository={r}" for r in repos],
           f"--http-port={http}", f"--grpc-port={grpc_}", f"--metrics-port={metrics}",
           "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1", *extra]
    log = open(log_path, "wb")
    # The installed `pier` (the environment as it is: the GPU machines' carried wheels live on PYTHONPATH)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=None if env is None else {**os.environ, **env})
    server = PierProcess(proc, http, grpc_, metrics, log_path)
    if not wait_ready:
        return server
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pier exited with {proc.returncode}:\n{server.log()}")
        try:
            if requests.get(f"{server.base()}/v2/health/ready", timeout=1).status_code == 200:
                return server
        except requests.RequestException:  # not listening yet, or too busy to answer within 1 s
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"pier not ready after {timeout}s:\n{server.log()}")


def build_test_repository(root: Path) -> Path:
    """The example models plus an identity model per datatype (`roundtrip_<type>`, [-1,-1])."""
    repo = root / "repo"
    shutil.copytree(EXAMPLE_REPO, repo)
    for dt in ROUND_TRIP_TYPES:
        name = f"roundtrip_{dt.lower()}"
        config_type = "TYPE_STRING" if dt == "BYTES" else f"TYPE_{dt}"
        config = (
            f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
            f'input [ {{ name: "INPUT0" data_type: {config_type} dims: [ -1 ] }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: {config_type} dims: [ -1 ] }} ]\n'
        )
        write_model(repo, name, config, identity_model(dt, [-1, -1]))
    one = ('name: "bytes_one"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'  # one string, no batching
           'input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
           'output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]\n')
    write_model(repo, "bytes_one", one, identity_model("BYTES", [1]))
    return repo


@pytest.fixture(scope="session")
def test_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_repository(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def pier(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PierProcess]:
    """One server for the read-mostly e2e tests; it must exit 0 on SIGTERM at the end."""
    log_path = tmp_path_factory.mktemp("logs") / "pier.log"
    server = start_pier([test_repo], log_path=log_path)
    yield server
    code = server.stop()
    assert code == 0, f"pier exited with {code} on SIGTERM:\n{server.log()}"


def numpy_inputs(mod, arrays: dict) -> list:
    """tritonclient InferInputs (`mod` is tritonclient.http or .grpc) carrying the given numpy arrays."""
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        inp = mod.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return inputs
