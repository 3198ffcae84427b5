"""Startup with a broken model: --exit-on-error=false keeps serving the others and reports the
file and line; the default stops with that error and a non-zero exit code. Also: CLI strictness
and graceful shutdown."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import requests

from tests.conftest import EXAMPLE_REPO, ROOT, start_pier

BROKEN = """name: "broken"
platform: "onnxruntime_onnx"
max_batch_size: 8 oops
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def _repo_with_broken_model(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text(BROKEN)
    shutil.copy(EXAMPLE_REPO / "simple" / "1" / "model.onnx", repo / "broken" / "1" / "model.onnx")
    return repo


@pytest.mark.frontends  # frontends start once the models are up
def test_exit_on_error_false_keeps_serving(tmp_path):
    repo = _repo_with_broken_model(tmp_path)
    server = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false", log_path=tmp_path / "log")
    try:
        base = server.base()
        body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}
                           for n in ("INPUT0", "INPUT1")]}
        r = requests.post(f"{base}/v2/models/simple/infer", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2] * 16
        config_path = str(repo / "broken" / "config.pbtxt")
        index = requests.post(f"{base}/v2/repository/index", timeout=10).json()
        broken = [row for row in index if row["name"] == "broken"]
        assert broken and broken[0]["state"] == "UNAVAILABLE"
        assert f"{config_path}:3:" in broken[0]["reason"]
        assert requests.get(f"{base}/v2/models/broken/ready", timeout=10).status_code == 400
        r = requests.post(f"{base}/v2/models/broken/infer", json=body, timeout=10)
        assert r.status_code == 404 and "broken" in r.json()["error"]
        assert f"{config_path}:3:" in server.log()
    finally:
        assert server.stop() == 0


@pytest.mark.frontends  # readiness is relayed
def test_strict_readiness_reports_not_ready_with_a_broken_model(tmp_path):
    repo = _repo_with_broken_model(tmp_path)
    server = start_pier([repo], "--exit-on-error=false", log_path=tmp_path / "log", wait_ready=False)
    try:
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "Pier is ready" not in server.log():
            time.sleep(0.1)
        assert requests.get(f"{server.base()}/v2/health/live", timeout=5).status_code == 200
        assert requests.get(f"{server.base()}/v2/health/ready", timeout=5).status_code == 400
        assert requests.get(f"{server.base()}/v2/models/simple/ready", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0


@pytest.mark.frontends  # a failed start stops the frontends it started
def test_exit_on_error_default_stops_with_the_error(tmp_path):
    repo = _repo_with_broken_model(tmp_path)
    server = start_pier([repo], log_path=tmp_path / "log", wait_ready=False)
    code = server.proc.wait(60)
    assert code != 0
    log = server.log()
    assert f"{repo / 'broken' / 'config.pbtxt'}:3:" in log
    assert "exit-on-error" in log


def test_unknown_flag_is_an_error():
    proc = subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={EXAMPLE_REPO}",
                           "--no-such-flag=1"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2
    assert "--no-such-flag" in proc.stderr


def test_load_model_needs_explicit_mode():
    proc = subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={EXAMPLE_REPO}",
                           "--load-model=simple"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2
    assert "explicit" in proc.stderr


def test_explicit_mode_loads_only_named_models(tmp_path):
    server = start_pier([EXAMPLE_REPO], "--model-control-mode=explicit", "--load-model=simple",
                        log_path=tmp_path / "log")
    try:
        assert requests.get(f"{server.base()}/v2/models/simple/ready", timeout=5).status_code == 200
        assert requests.get(f"{server.base()}/v2/models/identity_fp32/ready", timeout=5).status_code == 400
        index = requests.post(f"{server.base()}/v2/repository/index", timeout=5).json()
        assert {"name": "identity_fp32"} in index
        assert {"name": "simple", "version": "1", "state": "READY"} in index
    finally:
        assert server.stop() == 0


def test_metrics_config_flags(tmp_path):
    server = start_pier([EXAMPLE_REPO], "--metrics-config=counter_latencies=false", log_path=tmp_path / "log")
    try:
        text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).text
        assert 'nv_inference_count{model="simple",version="1"} 0' in text
        assert "nv_inference_request_duration_us" not in text
        assert "nv_inference_first_response_histogram_ms" not in text  # histograms are opt-in
        assert "nv_cpu_memory_total_bytes" in text and "process_resident_memory_bytes" in text
    finally:
        assert server.stop() == 0
    proc = subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={EXAMPLE_REPO}",
                           "--metrics-config=bogus_latencies=true"], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 2 and "unsupported --metrics-config" in proc.stderr


def test_summary_metrics_and_tritonserver_metric_flags(tmp_path):
    """tritonserver's metric flags start Pier unchanged; summaries count every request and give
    ordered quantiles; CPU gauges can be turned off."""
    server = start_pier([EXAMPLE_REPO], "--metrics-config=summary_latencies=true", "--allow-cpu-metrics=false",
                        "--allow-gpu-metrics=false", "--metrics-interval-ms=1000", log_path=tmp_path / "log")
    try:
        body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                           for n in ("INPUT0", "INPUT1")]}
        for _ in range(5):
            assert requests.post(f"{server.base()}/v2/models/simple/infer", json=body, timeout=5).status_code == 200
        text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).text
        labels = 'model="simple",version="1"'
        assert f"nv_inference_request_summary_us_count{{{labels}}} 5\n" in text
        assert "# HELP nv_inference_request_summary_us Summary of inference request duration in microseconds " \
               "(includes cached requests)\n# TYPE nv_inference_request_summary_us summary\n" in text
        quantiles = [float(re.search(rf'^nv_inference_request_summary_us{{{labels},quantile="{q}"}} (\S+)$',
                                     text, re.M).group(1)) for q in ("0.5", "0.9", "0.99", "0.999")]
        assert 0 < quantiles[0] <= quantiles[1] <= quantiles[2] <= quantiles[3]
        total = float(re.search(rf"^nv_inference_request_summary_us_sum{{{labels}}} (\S+)$", text, re.M).group(1))
        assert quantiles[0] <= total
        for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert f"nv_inference_{stage}_summary_us_count{{{labels}}} 5\n" in text
        assert "nv_cpu_utilization" not in text and "nv_pinned_memory_pool_total_bytes 0" in text
        assert "(does not include cached requests)" in text  # Triton's help texts, word for word
    finally:
        assert server.stop() == 0


@pytest.mark.frontends  # the frontends bind (or not) the ports
def test_allow_flags_turn_endpoints_off(tmp_path):
    server = start_pier([EXAMPLE_REPO], "--allow-grpc=false", "--allow-metrics=false", log_path=tmp_path / "log")
    try:
        import socket

        for port in (server.grpc_port, server.metrics_port):
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens
    finally:
        assert server.stop() == 0
