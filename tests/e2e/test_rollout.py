"""Poll mode and version rollout: the server follows the repository (edited config, new model,
deleted model, new version), and under continuous load from HTTP and gRPC clients a new version
is rolled out, split 90/10, rolled back, rolled forward and the old version unloaded, with zero
failed requests and every answer computed by the version it names."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from scripts.build_example_models import write_model
from tests.conftest import PierProcess, start_pier
from tests.e2e.test_model_control import index, wait_for
from tests.model_builders import ADD_CONFIG, add_constant_model

X = np.arange(8, dtype=np.float32).reshape(2, 4)


def place(repo: Path, staging: Path, model: str, version: int, constant: float) -> None:
    """Add a version folder atomically (written elsewhere, then renamed in), as a deploy would."""
    tmp = staging / f"{model}-{version}"
    tmp.mkdir(parents=True)
    (tmp / "model.onnx").write_bytes(add_constant_model(constant))
    os.rename(tmp, repo / model / str(version))


@pytest.mark.slow
def test_poll_mode_follows_the_repository(tmp_path: Path) -> None:
    repo, staging = tmp_path / "repo", tmp_path / "staging"
    write_model(repo, "addv", ADD_CONFIG.format(name="addv", policy="{ all { } }"), add_constant_model(1.0))
    write_model(repo, "gone", ADD_CONFIG.format(name="gone", policy="{ all { } }"), add_constant_model(3.0))
    server = start_pier([repo], "--model-control-mode=poll", "--repository-poll-secs=60", log_path=tmp_path / "p.log")
    base = server.base()
    try:
        # edited config.pbtxt (events, not the 60 s period, apply it)
        config = repo / "addv" / "config.pbtxt"
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))
        wait_for(lambda: requests.get(f"{base}/v2/models/addv/config").json()["max_batch_size"] == 4,
                 what="edited config applied")
        # a new version folder
        place(repo, staging, "addv", 2, 2.0)
        wait_for(lambda: index(server).get(("addv", "2"), ("",))[0] == "READY", what="version 2 loaded")
        assert requests.get(f"{base}/v2/models/addv").json()["versions"] == ["1", "2"]
        # a new model
        write_model(staging, "fresh", ADD_CONFIG.format(name="fresh", policy="{ all { } }"), add_constant_model(4.0))
        os.rename(staging / "fresh", repo / "fresh")
        wait_for(lambda: requests.get(f"{base}/v2/models/fresh/ready").status_code == 200, what="new model")
        client = httpclient.InferenceServerClient(server.http_url)
        inp = httpclient.InferInput("X", [2, 4], "FP32")
        inp.set_data_from_numpy(X)
        assert np.allclose(client.infer("fresh", [inp]).as_numpy("Y"), X + 4)
        # a deleted model
        shutil.rmtree(repo / "gone")
        wait_for(lambda: requests.get(f"{base}/v2/models/gone/ready").status_code != 200, what="model removed")
        wait_for(lambda: not any(name == "gone" for name, _ in index(server)), what="removed from the index")
        # a deleted version folder
        shutil.rmtree(repo / "addv" / "1")
        wait_for(lambda: requests.get(f"{base}/v2/models/addv/versions/1/ready").status_code != 200,
                 what="version 1 removed")
        assert client.infer("addv", [inp]).get_response()["model_version"] == "2"
        # a broken edit is reported and the served version keeps serving
        config.write_text("max_batch_size: [\n")
        time.sleep(1.5)
        assert np.allclose(client.infer("addv", [inp]).as_numpy("Y"), X + 2)
        assert "config.pbtxt:2:1" in server.log() or "config.pbtxt:1" in server.log()
        # load/unload of whole models belongs to the poller in this mode
        r = requests.post(f"{base}/v2/repository/models/addv/unload", timeout=10)
        assert r.status_code == 503 and "polling is enabled" in r.json()["error"]
        client.close()
    finally:
        assert server.stop() == 0, server.log()


@dataclass
class Answer:
    sent: float
    received: float
    version: str
    correct: bool


class Load:
    """Clients sending unversioned requests in a loop, over HTTP and gRPC, recording answers."""

    def __init__(self, server: PierProcess, per_protocol: int = 2) -> None:
        self.answers: list[Answer] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(server, proto), daemon=True)
                         for proto in ("http", "grpc") for _ in range(per_protocol)]

    def _run(self, server: PierProcess, proto: str) -> None:
        mod = httpclient if proto == "http" else grpcclient
        client = mod.InferenceServerClient(server.http_url if proto == "http" else server.grpc_url)
        inp = mod.InferInput("X", [2, 4], "FP32")
        inp.set_data_from_numpy(X)
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                result = client.infer("addv", [inp])
            except Exception as exc:  # every failure is a test failure
                with self._lock:
                    self.failures.append(f"{proto}: {exc}")
                continue
            version = (result.get_response()["model_version"] if proto == "http"
                       else result.get_response().model_version)
            correct = np.allclose(result.as_numpy("Y"), X + float(version))
            with self._lock:
                self.answers.append(Answer(sent, time.monotonic(), version, correct))
        client.close()

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def versions_since(self, t: float) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for a in self.answers:
                if a.sent >= t:
                    out[a.version] = out.get(a.version, 0) + 1
            return out

    def run_for(self, seconds: float, at_least: int = 40) -> float:
        """Let traffic run; return when it started."""
        start = time.monotonic()
        deadline = start + 60
        time.sleep(seconds)
        while sum(self.versions_since(start).values()) < at_least and time.monotonic() < deadline:
            time.sleep(0.1)
        return start


@pytest.mark.slow
def test_rollout_split_rollback_unload_under_load(tmp_path: Path) -> None:
    repo, staging = tmp_path / "repo", tmp_path / "staging"
    write_model(repo, "addv", ADD_CONFIG.format(name="addv", policy="{ all { } }"), add_constant_model(1.0))
    server = start_pier([repo], "--model-control-mode=poll", "--repository-poll-secs=60", log_path=tmp_path / "r.log")
    api = f"{server.base()}/v2/repository/models/addv"
    try:
        with Load(server) as load:
            load.run_for(0.5)
            assert set(load.versions_since(0)) == {"1"}
            # a new version appears and, as the newest READY version, takes the traffic
            place(repo, staging, "addv", 2, 2.0)
            wait_for(lambda: index(server).get(("addv", "2"), ("",))[0] == "READY", what="version 2 READY")
            t = load.run_for(1.0)
            assert set(load.versions_since(t)) == {"2"}
            # canary split 90/10
            r = requests.post(f"{api}/rollout", json={"weights": {"2": 90, "1": 10}}, timeout=10)
            assert r.status_code == 200 and r.json()["traffic"] == {"1": 10.0, "2": 90.0}
            assert index(server)[("addv", "1")] == ("READY", "traffic 10%")
            t = load.run_for(2.0, at_least=200)
            split = load.versions_since(t)
            assert set(split) == {"1", "2"} and split["2"] > 3 * split["1"], split
            # rollback: all traffic on the previous version, in one call
            r = requests.post(f"{api}/rollback", timeout=10)
            assert r.status_code == 200 and r.json()["traffic"] == {"1": 100.0}
            t = load.run_for(1.0)
            assert set(load.versions_since(t)) == {"1"}
            # forward again, then the old version is unloaded while traffic runs
            assert requests.post(f"{api}/rollout", json={"version": "2"}, timeout=10).status_code == 200
            assert requests.post(f"{api}/versions/1/unload", timeout=10).status_code == 200
            t = load.run_for(1.0)
            assert set(load.versions_since(t)) == {"2"}
            wait_for(lambda: index(server).get(("addv", "1")) == ("UNAVAILABLE", "unloaded"), what="v1 unloaded")
            metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
        assert load.failures == [], load.failures[:5]
        assert load.answers and all(a.correct for a in load.answers), "an answer did not match its version"
        counts = {v: sum(1 for a in load.answers if a.version == v) for v in ("1", "2")}
        assert counts["1"] > 0 and counts["2"] > 0
        line = next(m for m in metrics.splitlines() if m.startswith('nv_inference_count{model="addv",version="2"}'))
        assert float(line.split()[-1]) >= 1
        assert 'pier_model_traffic_percent{model="addv",version="2"} 100' in metrics
        assert 'nv_model_load_duration_secs{model="addv",version="2"}' in metrics
        log = server.log()
        assert "traffic for 'addv': v1 10%, v2 90%" in log and "unloaded 'addv' version 1" in log
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("body, message", [
    ({"weights": {"7": 100}}, "not READY"),
    ({"weights": {"1": -1}}, "must be a finite number >= 0, got -1.0"),
    ("NaN", "must be a finite number >= 0, got nan"),
    ({"weights": {"1": 0}}, "must not all be zero"),
    ({"weights": {"x": 1}}, "invalid model version"),
    ({}, "needs 'version' or 'weights'"),
    ({"weights": [1]}, "must be a JSON object"),
])
def test_rollout_refuses_bad_weights(pier: PierProcess, body: dict | str, message: str) -> None:
    data = f'{{"weights": {{"1": {body}}}}}' if isinstance(body, str) else json.dumps(body)  # NaN: not JSON proper
    r = requests.post(f"{pier.base()}/v2/repository/models/simple/rollout", data=data, timeout=10)
    assert r.status_code == 400 and message in r.json()["error"]
    assert requests.get(f"{pier.base()}/v2/repository/models/simple/traffic").json() == {
        "name": "simple", "traffic": {"1": 100.0}}


def test_rollback_of_an_unknown_model_is_404(pier: PierProcess) -> None:
    r = requests.post(f"{pier.base()}/v2/repository/models/nope/rollback", timeout=10)
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = requests.get(f"{pier.base()}/v2/repository/models/nope/traffic", timeout=10)
    assert r.status_code == 404 and "nope" in r.json()["error"]
