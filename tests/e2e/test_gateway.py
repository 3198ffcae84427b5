"""Behind an inference gateway: every HTTP answer says X-Request-Id (the caller's, else a new one)
and, when asked with `endpoint-load-metrics-format`, the model's load as ORCA's
`endpoint-load-metrics` header (vLLM's format); vLLM's POST /reset_prefix_cache, restricted as the
repository API is (the LLM engine's side: tests/backends/llm/test_async_engine.py)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import requests

from tests.conftest import EXAMPLE_REPO, start_pier

pytestmark = pytest.mark.frontends  # frontend processes answer v2 infer themselves

BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gateway")
    shutil.copytree(EXAMPLE_REPO / "identity_fp32", root / "repo" / "identity_fp32")
    proc = start_pier([root / "repo"], "--log-verbose=1", "--http-restricted-api=model-repository:admin-key=secret",
                      log_path=root / "pier.log")
    yield proc
    assert proc.stop() == 0


def test_request_id_is_echoed_or_made(server) -> None:
    url = server.base() + "/v2/models/identity_fp32/infer"
    r = requests.post(url, json=BODY, headers={"X-Request-Id": "gw-123"}, timeout=10)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "gw-123"
    made = {requests.post(url, json=BODY, timeout=10).headers["X-Request-Id"] for _ in range(2)}
    assert len(made) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", m) for m in made)
    # every answer: errors, other routes, streams, relayed ones (with frontend processes)
    for method, path, body in (("POST", "/v2/models/nope/infer", BODY), ("GET", "/v2/health/ready", None),
                               ("GET", "/v2/models/identity_fp32/config", None), ("GET", "/nope", None),
                               ("POST", "/v2/repository/index", {})):
        r = requests.request(method, server.base() + path, json=body, headers={"X-Request-Id": "gw-7"}, timeout=10)
        assert r.headers.get("X-Request-Id") == "gw-7", (path, r.status_code, dict(r.headers))
    server_log = server.log()
    assert "(X-Request-Id gw-123)" in server_log  # the verbose request line names the gateway's id


def test_orca_load_report_when_asked(server) -> None:
    url = server.base() + "/v2/models/identity_fp32/infer"
    assert "endpoint-load-metrics" not in requests.post(url, json=BODY, timeout=10).headers
    text = requests.post(url, json=BODY, headers={"endpoint-load-metrics-format": "text"}, timeout=10)
    as_json = requests.post(url, json=BODY, headers={"endpoint-load-metrics-format": "json"}, timeout=10)
    assert text.headers["endpoint-load-metrics"] == "TEXT named_metrics.num_requests_waiting=0.0"
    header = as_json.headers["endpoint-load-metrics"]
    assert header.startswith("JSON ") and json.loads(header[5:]) == {"named_metrics": {"num_requests_waiting": 0.0}}
    stats = requests.get(server.base() + "/v2/models/identity_fp32/stats",
                         headers={"endpoint-load-metrics-format": "text"}, timeout=10)
    assert stats.headers["endpoint-load-metrics"].startswith("TEXT ")


def test_reset_prefix_cache_is_restricted_like_the_repository_api(server) -> None:
    url = server.base() + "/reset_prefix_cache"
    refused = requests.post(url, timeout=10)
    assert refused.status_code == 403 and "admin-key" in refused.json()["error"]
    done = requests.post(url, headers={"admin-key": "secret"}, timeout=10)
    assert done.status_code == 200 and done.content == b""  # no model holds a prefix cache here: nothing to forget
    running = requests.post(url + "?reset_running_requests=true", headers={"admin-key": "secret"}, timeout=10)
    assert running.status_code == 400 and "reset_running_requests" in running.json()["error"]
