"""Checks a running Pier container from outside (scripts/image_test.sh starts it): ready, inference
through tritonclient HTTP and gRPC, metrics, and a SIGTERM during a request (the request finishes,
readiness turns 503 while it drains, the container exits 0).

    python scripts/image_check.py CONTAINER HTTP_PORT GRPC_PORT METRICS_PORT [--slim]

With --kube, the pod that `podman kube play` made of the chart's rendered Deployment: podman has it
running; its startup, readiness and liveness probes, sent as a kubelet would (each probe's path on
the port it names, reached through that port's hostPort), answer 200 (podman itself runs none of
them without systemd); simple over tritonclient HTTP and gRPC and the metrics through the
hostPorts; `podman pod stop` (SIGTERM) ends pier serve with status 0 within the grace period.

    python scripts/image_check.py --kube PLAYED_YAML POD CONTAINER
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def _wait_ok(url: str, timeout: float) -> float:
    """Seconds until `url` answered 200 (as a kubelet's httpGet probe counts success)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SystemExit(f"FAIL: {url} did not answer 200 within {timeout:.0f} s")


def _podman(*args: str) -> str:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True).stdout.strip()


def kube_main(played: str, pod: str, container: str) -> None:
    import yaml

    docs = [d for d in yaml.safe_load_all(Path(played).read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    (pier,) = spec["containers"]
    host = {p["name"]: (p.get("hostIP", "127.0.0.1"), p["hostPort"]) for p in pier["ports"] if p.get("hostPort")}
    assert set(host) == {"http", "grpc", "metrics"}, pier["ports"]
    state = json.loads(_podman("inspect", "--format", "{{json .State}}", container))
    assert state["Status"] == "running", state
    health = (state.get("Health") or state.get("Healthcheck") or {}).get("Status") or "none"
    print(f"ok   podman: pod {pod[:12]} running, container {container} {state['Status']} (podman's health: {health};"
          " it runs the chart's probes only with systemd)")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = pier[probe]["httpGet"]
        ip, port = host[get["port"]]
        budget = pier[probe].get("periodSeconds", 10) * pier[probe].get("failureThreshold", 3)
        if probe == "startupProbe":
            budget = min(budget, 180)  # the model load, within the budget the chart gives it
        took = _wait_ok(f"http://{ip}:{port}{get['path']}", max(budget, 10))
        print(f"ok   {probe}: GET {get['path']} on port {get['port']} (hostPort {ip}:{port}) 200 after {took:.1f} s")
    ip, http_port = host["http"]
    _simple(httpclient, f"{ip}:{http_port}")
    _simple(grpcclient, "{}:{}".format(*host["grpc"]))
    print("ok   simple over HTTP and gRPC (tritonclient), through the hostPorts")
    metrics = requests.get("http://{}:{}/metrics".format(*host["metrics"]), timeout=10).text
    assert 'nv_inference_count{model="simple",version="1"} 2' in metrics, metrics[:2000]
    print("ok   metrics, through the hostPort")
    grace = spec["terminationGracePeriodSeconds"]
    start = time.monotonic()
    _podman("pod", "stop", "--time", str(grace), pod)
    took = time.monotonic() - start
    code = _podman("inspect", "--format", "{{.State.ExitCode}}", container)
    assert code == "0" and took < grace, f"exit status {code} after {took:.1f} s (grace {grace} s)"
    print(f"ok   podman pod stop (SIGTERM): pier serve exited 0 in {took:.1f} s (grace period {grace} s)")


def main() -> None:
    if sys.argv[1] == "--kube":
        kube_main(*sys.argv[2:5])
        return
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
