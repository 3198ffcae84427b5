"""SIGTERM: stop taking requests, finish those in flight (queued ones included), exit 0."""

from __future__ import annotations

import signal
import threading
import time

import requests

from tests.conftest import start_pier
from tests.model_builders import slow_model

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

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(min(0.5, one / 2))  # all four accepted; one running, three queued
    unfinished = 4 - len(results)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    try:
        late = requests.post(url, json=body, timeout=10).status_code
    except requests.ConnectionError:
        late = "refused"
    for t in threads:
        t.join(120)
    assert unfinished >= 2, f"requests finished before SIGTERM ({one:.3f}s each): test proves nothing"
    assert results == [200, 200, 200, 200], (results, server.log())
    assert late in (503, "refused")
    assert server.proc.wait(60) == 0
    assert "stopped" in server.log()
