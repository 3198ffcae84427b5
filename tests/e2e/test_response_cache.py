"""Triton's response cache through the real server and the real clients: `--cache-config
local,size=N` plus a model's `response_cache { enable: true }`. Statistics and metrics as the
reference Triton 2.51 reported them for the same sequence of requests (hits count as successes,
not as inferences or executions)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import EXAMPLE_REPO, start_pier


def _repo(root: Path) -> Path:
    repo = root / "repo"
    for name, cached in (("cached", True), ("plain", False)):
        shutil.copytree(EXAMPLE_REPO / "simple", repo / name)
        config = (repo / name / "config.pbtxt").read_text().replace('name: "simple"', f'name: "{name}"')
        (repo / name / "config.pbtxt").write_text(config + ("response_cache { enable: true }\n" if cached else ""))
    return repo


def _infer(client: httpclient.InferenceServerClient, model: str, offset: int, outputs: list[str] | None = None,
           request_id: str = "") -> httpclient.InferResult:
    a = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    b = httpclient.InferInput("INPUT1", [1, 16], "INT32")
    a.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16) + offset)
    b.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    wanted = [httpclient.InferRequestedOutput(o) for o in outputs] if outputs else None
    return client.infer(model, [a, b], outputs=wanted, request_id=request_id)


def _stats(server, model: str) -> dict:
    s = requests.get(f"{server.base()}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]
    st = s["inference_stats"]
    return {"inference_count": s["inference_count"], "execution_count": s["execution_count"],
            **{k: st[k]["count"] for k in ("success", "compute_infer", "cache_hit", "cache_miss")}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cache")
    repo = _repo(root)
    (repo / "decoupled_cached" / "1").mkdir(parents=True)
    (repo / "decoupled_cached" / "1" / "model.py").write_text("class TritonPythonModel:\n    pass\n")
    (repo / "decoupled_cached" / "config.pbtxt").write_text(
        'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        "model_transaction_policy { decoupled: true }\nresponse_cache { enable: true }\n")
    proc = start_pier([repo], "--cache-config=local,size=1048576", "--metrics-config=summary_latencies=true",
                      "--exit-on-error=false",
                      "--strict-readiness=false", log_path=root / "pier.log")
    yield proc
    assert proc.stop() == 0, proc.log()


def test_identical_requests_are_answered_from_the_cache(server) -> None:
    h = httpclient.InferenceServerClient(server.http_url)
    first = _infer(h, "cached", 0)
    again = _infer(h, "cached", 0, request_id="second")
    assert again.as_numpy("OUTPUT0").tolist() == first.as_numpy("OUTPUT0").tolist()
    assert again.get_response()["id"] == "second"  # the hit answers with the new request's id
    _infer(h, "cached", 5)  # other inputs: a miss
    only = _infer(h, "cached", 0, outputs=["OUTPUT1"])  # other outputs asked for: its own entry
    assert only.as_numpy("OUTPUT0") is None and only.as_numpy("OUTPUT1").tolist() == [[i - 1 for i in range(16)]]
    _infer(h, "cached", 0, outputs=["OUTPUT1"])
    g = grpcclient.InferenceServerClient(server.grpc_url)  # gRPC shares the cache
    a = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    b = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
    a.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    b.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    assert g.infer("cached", [a, b]).as_numpy("OUTPUT0")[0, 3] == 4
    assert _stats(server, "cached") == {"inference_count": 3, "execution_count": 3, "success": 6,
                                         "compute_infer": 3, "cache_hit": 3, "cache_miss": 3}
    for _ in range(2):
        _infer(h, "plain", 0)  # no response_cache in its config: runs every time
    assert _stats(server, "plain") == {"inference_count": 2, "execution_count": 2, "success": 2,
                                        "compute_infer": 2, "cache_hit": 0, "cache_miss": 0}
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 3' in metrics
    assert 'nv_cache_num_misses_per_model{model="cached",version="1"} 3' in metrics
    assert 'nv_cache_num_hits_per_model{model="plain"' not in metrics  # only models that enable the cache
    assert 'nv_inference_count{model="cached",version="1"} 3' in metrics
    assert "nv_cache_num_entries 3" in metrics
    assert "nv_cache_num_hits 3" in metrics and "nv_cache_num_lookups 6" in metrics  # cache-wide totals
    # with summary_latencies, Triton's per-model cache summaries (qa/L0_metrics)
    for kind in ("hit", "miss"):
        name = f"nv_cache_{kind}_summary_per_model"
        assert f"# HELP {name} Summary of cache {kind} counts/durations per model, in microseconds." in metrics
        assert f'{name}_count{{model="cached",version="1"}} 3' in metrics
        assert re.search(rf'^{name}{{model="cached",version="1",quantile="0.5"}} \d+$', metrics, re.M)
        assert f'{name}_count{{model="plain"' not in metrics
    index = {m["name"]: m for m in requests.post(f"{server.base()}/v2/repository/index", timeout=10).json()}
    assert index["decoupled_cached"]["state"] == "UNAVAILABLE"  # as Triton refuses it
    assert "Response Cache does not currently support model 'decoupled_cached'" in index["decoupled_cached"]["reason"]


def test_least_recently_used_entries_are_evicted(tmp_path: Path) -> None:
    # Each answer holds two INT32 [1, 16] outputs: 128 bytes. Room for two.
    server = start_pier([_repo(tmp_path)], "--cache-config=local,size=300", log_path=tmp_path / "log")
    try:
        h = httpclient.InferenceServerClient(server.http_url)
        for offset in (1, 2, 1, 3, 1, 2):  # 2 is evicted by 3 (1 was used more recently); 1 stays
            _infer(h, "cached", offset)
        stats = _stats(server, "cached")
        assert stats["cache_hit"] == 2 and stats["cache_miss"] == 4 and stats["execution_count"] == 4
    finally:
        assert server.stop() == 0


def test_no_cache_without_cache_config(tmp_path: Path) -> None:
    server = start_pier([_repo(tmp_path)], log_path=tmp_path / "log")
    try:
        h = httpclient.InferenceServerClient(server.http_url)
        for _ in range(2):
            _infer(h, "cached", 0)
        assert _stats(server, "cached")["execution_count"] == 2
        metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
        # as Triton 2.51: the per-model families of a model that enables the cache, at zero; no
        # cache-wide families
        assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 0' in metrics
        assert 'model="plain"' not in metrics.split("nv_cache_num_hits_per_model", 1)[1].split("# HELP")[0]
        assert "nv_cache_num_entries" not in metrics
    finally:
        assert server.stop() == 0


def test_a_reloaded_model_never_answers_from_the_old_load(tmp_path: Path) -> None:
    """Triton 2.51 kept serving the old load's cached answers after a reload; Pier does not."""
    repo = _repo(tmp_path)
    server = start_pier([repo], "--cache-config=local,size=1048576", "--model-control-mode=explicit",
                        "--load-model=cached", log_path=tmp_path / "log")
    try:
        h = httpclient.InferenceServerClient(server.http_url)
        for _ in range(2):
            _infer(h, "cached", 0)
        assert _stats(server, "cached")["cache_hit"] == 1
        config = repo / "cached" / "config.pbtxt"
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))
        h.load_model("cached")  # the config changed: a new load
        _infer(h, "cached", 0)
        stats = _stats(server, "cached")
        assert stats["cache_hit"] == 0 and stats["cache_miss"] == 1 and stats["execution_count"] == 1
    finally:
        assert server.stop() == 0
