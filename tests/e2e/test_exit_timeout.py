"""--exit-timeout-secs bounds the whole shutdown: a python model's execute stuck for 120 s (in its
stub, or in the server's own process) or a decoupled stream left open cannot hold the exit. At the
timeout the server exits with status 1 (as Triton: "Exit timeout expired. Exiting immediately.")
after a log line naming what still ran, and leaves no child process behind (stubs, frontend
processes: every child of pier.ipc's supervisors is killed and reaped first) and no socket folder
(the server's TMPDIR stays empty)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PierProcess, numpy_inputs, private_tmpdir, start_pier
from tests.model_builders import write_sleep_models
from tests.processes import alive, descendants

pytestmark = pytest.mark.frontends  # the frontends are children too, and they drain with the server

TIMEOUT_S = 3.0
SLACK_S = 5.0  # two shared cores: the kill, the reaping and the log flush after the deadline


def _server(tmp_path: Path, extra: str = "") -> PierProcess:
    repo = tmp_path / "repo"
    write_sleep_models(repo, extra)
    return start_pier([repo], f"--exit-timeout-secs={TIMEOUT_S:g}", log_path=tmp_path / "log",
                      env=private_tmpdir(tmp_path))


def _swallow(call: Callable[[], object]) -> Callable[[], None]:
    """`call` for a thread of its own: the server it waits on exits under it."""
    def run() -> None:
        try:
            call()
        except Exception:
            pass
    return run


def _exits_at_the_timeout(server: PierProcess, what: str, or_else: str | None = None) -> None:
    children = descendants(server.proc.pid)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(TIMEOUT_S + SLACK_S)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise AssertionError(f"still running {TIMEOUT_S + SLACK_S:g} s after SIGTERM:\n{server.log()}") from None
    took = time.monotonic() - t0
    log = server.log()
    assert code == 1, (code, log)
    assert took >= TIMEOUT_S - 0.2, (took, log)
    said = ["exit timeout: 3 s after the signal, 1 request still running: " + what]
    if or_else is not None:
        said.append("exit timeout: 3 s after the signal, " + or_else)
    assert any(s in log for s in said), (said, log)
    assert not alive(children), (alive(children), log)
    left = list((server.log_path.parent / "tmp").rglob("*"))
    assert not left, ("scratch folders left behind", left, log)


@pytest.mark.parametrize("mode", ["process", "in_process"])
def test_a_stuck_execute_cannot_hold_the_exit(tmp_path: Path, mode: str) -> None:
    import tritonclient.http as httpclient

    server = _server(tmp_path, f'parameters {{ key: "execution_mode" value {{ string_value: "{mode}" }} }}')
    client = httpclient.InferenceServerClient(server.http_url, connection_timeout=300, network_timeout=300)
    inputs = numpy_inputs(httpclient, {"SECONDS": np.array([120], np.float32)})
    threading.Thread(target=_swallow(lambda: client.infer("sleep_py", inputs, request_id="stuck")), daemon=True).start()
    server.wait_for_log("sleep_py: sleeping 120 s")  # it runs
    if mode == "process":
        assert descendants(server.proc.pid), "the model's stub process"
    _exits_at_the_timeout(server, "model 'sleep_py' version 1 request 'stuck'")


def test_a_stream_left_open_cannot_hold_the_exit(tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient

    server = _server(tmp_path)
    got: list[object] = []
    first = threading.Event()

    def callback(result, error) -> None:
        got.append(error if error is not None else int(result.as_numpy("OUT")[0]))
        first.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback)
    inputs = numpy_inputs(grpcclient, {"SECONDS": np.array([120], np.float32), "COUNT": np.array([2], np.int32)})
    client.async_stream_infer("sleep_decoupled_py", inputs, request_id="open")  # one response, then 120 s
    if not first.wait(30):
        server.proc.kill()  # a failed test leaves no server behind
        raise AssertionError(f"no first response:\n{server.log()}")
    assert got == [0]
    _exits_at_the_timeout(server, "model 'sleep_decoupled_py' version 1 request 'open'")
    client.stop_stream(cancel_requests=True)


@pytest.mark.llm
def test_a_client_that_never_reads_cannot_hold_the_exit(tmp_path: Path) -> None:
    """An OpenAI stream whose client never reads stays in flight (the server waits to write): at
    the timeout the server exits 1 all the same, naming it, and the LLM engine core goes too."""
    import json
    import socket

    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path / "repo"
    build_model(repo / "tiny_llama" / "1", "llama", max_position_embeddings=4096)
    (repo / "tiny_llama" / "config.pbtxt").write_text(
        'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "8000000" } }\n')
    server = start_pier([repo], f"--exit-timeout-secs={TIMEOUT_S:g}", log_path=tmp_path / "log", timeout=120,
                        env=private_tmpdir(tmp_path))
    # about 10 MB of events (two choices, five alternatives per token): more than the socket buffers hold
    body = json.dumps({"model": "tiny_llama", "prompt": "never read", "max_tokens": 4000, "temperature": 1, "seed": 0,
                       "stream": True, "ignore_eos": True, "n": 2, "logprobs": 5}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.connect(("127.0.0.1", server.http_port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-ID: slow\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(2.0)  # it streams, then waits for us
    try:
        assert any("engine_core" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
                   for p in descendants(server.proc.pid)), "the engine core process"
        # With frontend processes the engine may have finished: the frontend holds what it could not write
        _exits_at_the_timeout(server, "model 'tiny_llama' version 1 request ",
                              "still stopping the endpoints: frontend process ")
    finally:
        sock.close()
