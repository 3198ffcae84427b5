"""SIGTERM: stop taking requests, finish those in flight (queued ones included), exit 0."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import requests
from onnx import TensorProto, helper, numpy_helper

from scripts.build_example_models import IR_VERSION, OPSET
from tests.conftest import start_pier

SLOW_CONFIG = """name: "slow"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
"""


def slow_model(layers: int = 40) -> bytes:
    """Y = mean over 2048 rows of tanh(...tanh(expand(X) @ W)...): a few hundred ms on a CPU."""
    w = numpy_helper.from_array(np.eye(256, dtype=np.float32) * 0.5, "W")
    shape = numpy_helper.from_array(np.array([2048, 256], dtype=np.int64), "S")
    nodes = [helper.make_node("Expand", ["X", "S"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "W"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("ReduceMean", [f"h{layers}"], ["Y"], axes=[0], keepdims=1))
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 256])], [w, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    assert OPSET == 17
    return model.SerializeToString()


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
