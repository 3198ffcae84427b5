"""Checks a running Pier container from outside (scripts/image_test.sh starts it): ready, inference
through tritonclient HTTP and gRPC, metrics, and a SIGTERM during a request (the request finishes,
readiness turns 503 while it drains, the container exits 0).

    python scripts/image_check.py CONTAINER HTTP_PORT GRPC_PORT METRICS_PORT [--slim]
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def _wait_ready(base: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/v2/health/ready", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SystemExit(f"FAIL: not ready after {timeout:.0f} s")


def _simple(client_mod, url: str) -> None:
    client = client_mod.InferenceServerClient(url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [client_mod.InferInput("INPUT0", [1, 16], "INT32"), client_mod.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    out = client.infer("simple", inputs)
    assert np.array_equal(out.as_numpy("OUTPUT0"), a + 1), out.as_numpy("OUTPUT0")


def main() -> None:
    container, http_port, grpc_port, metrics_port = sys.argv[1], *sys.argv[2:5]
    base = f"http://127.0.0.1:{http_port}"
    _wait_ready(base)
    print("ok   ready")
    _simple(httpclient, f"127.0.0.1:{http_port}")
    _simple(grpcclient, f"127.0.0.1:{grpc_port}")
    print("ok   simple over HTTP and gRPC (tritonclient)")
    metrics = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert 'nv_inference_count{model="simple",version="1"} 2' in metrics, metrics[:2000]
    print("ok   metrics")
    if "--slim" not in sys.argv:
        r = requests.get(f"{base}/v2/models/mlp_torchscript/ready", timeout=10)
        assert r.status_code == 200, r.text
        print("ok   TorchScript model ready")
    # SIGTERM while a request runs: it finishes; readiness says 503 meanwhile; exit status 0
    result: dict[str, object] = {}

    def slow() -> None:
        body = {"inputs": [{"name": "SECONDS", "shape": [1], "datatype": "FP32", "data": [3.0]}]}
        result["response"] = requests.post(f"{base}/v2/models/sleep_py/infer", json=body, timeout=60)

    worker = threading.Thread(target=slow)
    worker.start()
    time.sleep(1.0)
    subprocess.run(["docker", "kill", "--signal", "TERM", container], check=True, capture_output=True)
    time.sleep(0.3)
    try:
        ready = requests.get(f"{base}/v2/health/ready", timeout=2).status_code
    except requests.RequestException:
        ready = None  # already closed to new connections
    worker.join()
    response = result["response"]
    assert isinstance(response, requests.Response) and response.status_code == 200, response
    assert ready in (503, None), ready
    code = subprocess.run(["docker", "wait", container], check=True, capture_output=True, text=True).stdout.strip()
    assert code == "0", f"exit status {code}"
    print(f"ok   SIGTERM during a request: it finished (200), readiness {ready}, exit 0")


if __name__ == "__main__":
    main()
