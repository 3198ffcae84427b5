"""The data plane's own guards (no gateway in front): API keys over HTTP (Triton's and OpenAI's
error shapes), gRPC metadata, with tritonclient, the openai SDK and plain HTTP; health probes and
the metrics port stay open. Rate limits per model and per key: 429 with Retry-After (HTTP),
RESOURCE_EXHAUSTED (gRPC), success again once the bucket refills, other models unaffected, and the
refusals counted in a metric."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, ROOT, PierProcess, start_pier


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for model in ("simple", "identity_fp32"):
        shutil.copytree(EXAMPLE_REPO / model, repo / model)
    return repo


def _simple(mod, url: str, headers: dict | None = None):
    client = mod.InferenceServerClient(url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [mod.InferInput("INPUT0", [1, 16], "INT32"), mod.InferInput("INPUT1", [1, 16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return client.infer("simple", inputs, headers=headers)


SIMPLE_BODY = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                          for n in ("INPUT0", "INPUT1")]}
IDENTITY_BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


@pytest.mark.frontends  # API keys are checked in the frontend
def test_api_keys(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("# one per line\nk2\n")
    server = start_pier([_repo(tmp_path)], "--api-key=k1", f"--api-key-file={tmp_path / 'keys'}",
                        log_path=tmp_path / "pier.log")
    base = server.base()
    try:
        r = requests.post(f"{base}/v2/models/simple/infer", json=SIMPLE_BODY, timeout=10)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert "didn't provide an API key" in r.json()["error"]
        r = requests.post(f"{base}/v2/models/simple/infer", json=SIMPLE_BODY, timeout=10,
                          headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"] == "Incorrect API key provided."
        for headers in ({"Authorization": "Bearer k1"}, {"api-key": "k2"}):
            assert requests.post(f"{base}/v2/models/simple/infer", json=SIMPLE_BODY, headers=headers,
                                 timeout=10).status_code == 200
        for path in ("/v2/health/live", "/v2/health/ready", "/health"):  # probes stay open
            assert requests.get(f"{base}{path}", timeout=10).status_code == 200, path
        assert requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).status_code == 200
        # tritonclient, HTTP and gRPC
        with pytest.raises(InferenceServerException, match="401"):
            _simple(httpclient, server.http_url)
        assert _simple(httpclient, server.http_url, {"Authorization": "Bearer k1"}).as_numpy("OUTPUT0") is not None
        with pytest.raises(InferenceServerException) as err:
            _simple(grpcclient, server.grpc_url)
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
        assert _simple(grpcclient, server.grpc_url, {"authorization": "Bearer k1"}).as_numpy("OUTPUT0") is not None
        assert grpcclient.InferenceServerClient(server.grpc_url).is_server_live()  # open
        # the openai SDK: OpenAI's 401 shape
        with pytest.raises(openai.AuthenticationError) as auth:
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong").models.list()
        assert auth.value.body["code"] == "invalid_api_key"
        assert openai.OpenAI(base_url=f"{base}/v1", api_key="k2").models.list().data == []
    finally:
        assert server.stop() == 0


def _metric(server: PierProcess, line: str) -> float:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    return sum(float(row.rsplit(" ", 1)[1]) for row in text.splitlines() if row.startswith(line))


@pytest.mark.frontends  # the frontend asks the server's rate limits (ADMIT)
def test_rate_limits(tmp_path: Path) -> None:
    server = start_pier([_repo(tmp_path)], "--rate-limit-model=simple=1:2", "--api-key=k1", "--api-key=k2",
                        "--rate-limit-key=0.5:3", log_path=tmp_path / "pier.log")
    base = server.base()
    k1, k2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    try:
        codes = [requests.post(f"{base}/v2/models/simple/infer", json=SIMPLE_BODY, headers=k1, timeout=10)
                 for _ in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429]
        assert int(codes[2].headers["Retry-After"]) >= 1
        assert "rate limit exceeded for model 'simple'" in codes[2].json()["error"]
        # another model, another key's bucket: unaffected
        assert requests.post(f"{base}/v2/models/identity_fp32/infer", json=IDENTITY_BODY, headers=k2,
                             timeout=10).status_code == 200
        with pytest.raises(InferenceServerException) as err:
            _simple(grpcclient, server.grpc_url, {"authorization": "Bearer k2"})
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        time.sleep(1.1)  # the model's bucket refills a token a second
        assert requests.post(f"{base}/v2/models/simple/infer", json=SIMPLE_BODY, headers=k2,
                             timeout=10).status_code == 200
        # k1 took 2 of its 3 (the refused request took none) and refills slowly: one more, then the key limit
        got = [requests.post(f"{base}/v2/models/identity_fp32/infer", json=IDENTITY_BODY, headers=k1,
                             timeout=10).status_code for _ in range(3)]
        assert got[-1] == 429 and got[0] == 200, got
        r = requests.post(f"{base}/v1/completions", json={"model": "x", "prompt": "y"}, headers=k1, timeout=10)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"  # OpenAI's shape
        assert _metric(server, 'pier_rate_limited_requests_total{model="simple",scope="model"}') >= 2
        assert _metric(server, 'pier_rate_limited_requests_total{model="identity_fp32",scope="key"}') >= 1
    finally:
        assert server.stop() == 0


def test_bad_guard_flags_are_refused() -> None:
    for flags, text in ((["--rate-limit-model=fast"], "expected RATE[:BURST]"),
                        (["--rate-limit-model=simple=0"], "the rate must be > 0"),
                        (["--rate-limit-key=5"], "--rate-limit-key needs API keys"),
                        (["--api-key-file=/nonexistent/keys"], "--api-key-file /nonexistent/keys")):
        proc = subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={EXAMPLE_REPO}", *flags],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 2 and text in proc.stderr, (flags, proc.stderr)
