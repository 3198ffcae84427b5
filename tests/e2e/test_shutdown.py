"""SIGTERM: readiness fails at once; requests in flight (queued ones included) finish, and so do
those that still arrive while they drain (as Triton), answered with `Connection: close`; exit 0."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import requests

from tests.conftest import start_pier
from tests.model_builders import slow_model

pytestmark = pytest.mark.frontends  # the server tells its frontends when it drains, then stops them

SLOW_CONFIG = """name: "slow"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
"""


def test_sigterm_finishes_in_flight_requests(tmp_path):
    repo = tmp_path / "repo"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    (repo / "slow" / "1" / "model.onnx").write_bytes(slow_model())
    server = start_pier([repo], log_path=tmp_path / "log")
    body = {"inputs": [{"name": "X", "shape": [1, 256], "datatype": "FP32", "data": [1.0] * 256}]}
    url = f"{server.base()}/v2/models/slow/infer"
    t0 = time.monotonic()
    assert requests.post(url, json=body, timeout=60).status_code == 200
    one = time.monotonic() - t0
    results: list[int | str] = []

    def call() -> None:
        try:
            results.append(requests.post(url, json=body, timeout=120).status_code)
        except requests.RequestException as exc:
            results.append(repr(exc))

    idle = requests.Session()  # a kept-alive connection, idle when SIGTERM comes
    assert idle.post(url, json=body, timeout=60).status_code == 200
    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(min(0.5, one / 2))  # all four accepted; one running, three queued
    unfinished = 4 - len(results)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    # while the four drain, both at once: a new connection, and the kept-alive one (served, then closed)
    during: dict[str, requests.Response] = {}
    sends = [threading.Thread(target=lambda: during.__setitem__("late", requests.post(url, json=body, timeout=60))),
             threading.Thread(target=lambda: during.__setitem__("again", idle.post(url, json=body, timeout=60)))]
    for t in sends:
        t.start()
    ready = requests.get(f"{server.base()}/v2/health/ready", timeout=10)
    assert ready.status_code == 503 and "Server exiting" in ready.text, ready.text
    assert requests.get(f"{server.base()}/v2/health/live", timeout=10).status_code == 200  # draining, alive
    for t in threads + sends:
        t.join(120)
    late, again = during["late"], during["again"]
    assert unfinished >= 2, f"requests finished before SIGTERM ({one:.3f}s each): test proves nothing"
    assert results == [200, 200, 200, 200], (results, server.log())
    assert late.status_code == 200 and again.status_code == 200, (late.text, again.text, server.log())
    assert again.headers.get("Connection") == "close" and late.headers.get("Connection") == "close"
    assert server.proc.wait(60) == 0
    assert "stopped" in server.log()


def test_a_stream_request_while_draining_gets_tritons_refusal(tmp_path):
    """On a gRPC stream, what was sent before SIGTERM finishes; a new request sent while the server
    drains is refused in Triton's words (its schedulers stop at SIGTERM): a stream has no
    `Connection: close` to end it after one more answer."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    repo = tmp_path / "repo"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    (repo / "slow" / "1" / "model.onnx").write_bytes(slow_model())
    server = start_pier([repo], log_path=tmp_path / "log")
    got: list[tuple[str, str]] = []
    done = threading.Event()

    def callback(result, error) -> None:
        got.append(("error", str(error)) if error is not None else ("ok", result.get_response().id))
        if len(got) == 4:
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = grpcclient.InferInput("X", [1, 256], "FP32")
    x.set_data_from_numpy(np.ones((1, 256), np.float32))
    client.start_stream(callback)
    for i in range(3):  # one runs, two wait: the drain lasts until they are done
        client.async_stream_infer("slow", [x], request_id=f"before-{i}")
    time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    client.async_stream_infer("slow", [x], request_id="late")
    assert done.wait(60), (got, server.log())
    client.stop_stream()
    assert sorted(r for kind, r in got if kind == "ok") == ["before-0", "before-1", "before-2"], got
    refused = [r for kind, r in got if kind == "error"]
    assert len(refused) == 1 and "[request id: late] Server is stopping, scheduler for model has stopped " \
        "accepting new inference requests" in refused[0], got
    assert server.proc.wait(60) == 0
