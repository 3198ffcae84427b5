"""Model control in explicit mode: the repository API over HTTP and gRPC (tritonclient's
load_model / unload_model / get_model_repository_index), config and file overrides, failed
loads that leave the served version alone, per-version load/unload, racing calls, and the
`pier model` CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from scripts.build_example_models import write_model
from tests.conftest import ROOT, PierProcess, start_pier
from tests.model_builders import ADD_CONFIG, add_constant_model

X = np.arange(8, dtype=np.float32).reshape(2, 4)


def add_infer(client: httpclient.InferenceServerClient, name: str, version: str = "") -> tuple[str, np.ndarray]:
    inp = httpclient.InferInput("X", list(X.shape), "FP32")
    inp.set_data_from_numpy(X)
    result = client.infer(name, [inp], model_version=version)
    return result.get_response()["model_version"], result.as_numpy("Y")


def index(server: PierProcess) -> dict[tuple[str, str], tuple[str, str]]:
    rows = requests.post(f"{server.base()}/v2/repository/index", timeout=10).json()
    return {(r["name"], r.get("version", "")): (r.get("state", ""), r.get("reason", "")) for r in rows}


def wait_for(predicate, timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("control")
    write_model(root, "addv", ADD_CONFIG.format(name="addv", policy="{ latest { num_versions: 1 } }"),
                add_constant_model(1.0), version=1)
    write_model(root, "addv", None, add_constant_model(2.0), version=2)
    write_model(root, "canary", ADD_CONFIG.format(name="canary", policy="{ latest { num_versions: 1 } }"),
                add_constant_model(1.0), version=1)
    write_model(root, "other", ADD_CONFIG.format(name="other", policy="{ all { } }"), add_constant_model(10.0))
    write_model(root, "race", ADD_CONFIG.format(name="race", policy="{ all { } }"), add_constant_model(5.0))
    broken = root / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text(ADD_CONFIG.format(name="broken", policy="{ all { } }"))
    (broken / "1" / "model.onnx").write_bytes(b"this is not an onnx model")
    utf16 = root / "utf16"  # a config saved by an editor in UTF-16: its bytes are not UTF-8 text
    (utf16 / "1").mkdir(parents=True)
    (utf16 / "config.pbtxt").write_bytes(ADD_CONFIG.format(name="utf16", policy="{ all { } }").encode("utf-16"))
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("logs") / "explicit.log"
    proc = start_pier([repo], "--model-control-mode=explicit", "--load-model=other", log_path=log_path)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def http(server: PierProcess):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield client
    client.close()


def test_explicit_start_loads_only_named_models(server: PierProcess) -> None:
    rows = index(server)
    assert rows[("other", "1")] == ("READY", "")
    assert ("addv", "") in rows and ("broken", "") in rows  # listed, never loaded: name only
    assert requests.get(f"{server.base()}/v2/models/addv/ready").status_code == 400


def test_load_serves_the_policy_version_and_unload_drains(server: PierProcess, http) -> None:
    http.load_model("addv")
    assert http.is_model_ready("addv")
    version, y = add_infer(http, "addv")
    assert version == "2" and np.allclose(y, X + 2)  # latest 1 -> version 2 only
    assert index(server)[("addv", "2")] == ("READY", "")
    http.unload_model("addv")
    wait_for(lambda: index(server).get(("addv", "2")) == ("UNAVAILABLE", "unloaded"), what="addv unloaded")
    assert not http.is_model_ready("addv")
    assert http.is_server_ready()  # strict readiness tolerates versions unloaded on purpose
    with pytest.raises(InferenceServerException):
        add_infer(http, "addv")
    http.unload_model("never_loaded_model")  # unloading what is not loaded succeeds, as in Triton


def test_config_override_replaces_config_pbtxt(server: PierProcess, http) -> None:
    http.load_model("addv", config=json.dumps({"max_batch_size": 1, "version_policy": {"all": {}}}))
    assert http.get_model_config("addv")["max_batch_size"] == 1
    rows = index(server)
    assert rows[("addv", "1")][0] == "READY" and rows[("addv", "2")][0] == "READY"
    with pytest.raises(InferenceServerException, match="batch"):
        add_infer(http, "addv", "1")  # a batch of 2 is refused with max_batch_size 1
    # a plain load goes back to config.pbtxt (latest 1, max_batch_size 8)
    http.load_model("addv")
    assert http.get_model_config("addv")["max_batch_size"] == 8
    assert add_infer(http, "addv")[0] == "2"
    wait_for(lambda: index(server).get(("addv", "1")) == ("UNAVAILABLE", "unloaded"), what="v1 retired")
    # an override that is not a ModelConfig: Triton's words, in the answer and in the server log
    # (L0_http's test.sh greps the log for them); what serves keeps serving
    with pytest.raises(InferenceServerException, match="Invalid config override: failed to parse"):
        http.load_model("addv", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    wait_for(lambda: "Invalid config override" in server.log(), what="the refusal logged")
    assert add_infer(http, "addv")[0] == "2"


def test_load_with_files_in_the_request(server: PierProcess, http, tmp_path: Path) -> None:
    config = {"backend": "onnxruntime", "max_batch_size": 8,
              "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
              "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}
    http.load_model("uploaded", config=json.dumps(config),
                    files={"file:3/model.onnx": add_constant_model(7.0)})
    version, y = add_infer(http, "uploaded")
    assert version == "3" and np.allclose(y, X + 7)
    with pytest.raises(InferenceServerException, match="config"):
        http.load_model("uploaded2", files={"file:1/model.onnx": add_constant_model(1.0)})
    assert not any(name == "uploaded2" for name, _ in index(server))  # as Triton: no trace of the refused load
    with pytest.raises(InferenceServerException, match="invalid file parameter"):
        http.load_model("uploaded3", config=json.dumps(config), files={"file:1/../../escape.onnx": b"x"})
    assert not any(name == "uploaded3" for name, _ in index(server))  # refused before the load: no trace
    http.unload_model("uploaded")
    wait_for(lambda: index(server).get(("uploaded", "3")) == ("UNAVAILABLE", "unloaded"), what="uploaded unloaded")


def test_load_with_a_file_at_the_model_root(server: PierProcess, http) -> None:
    """As Triton: a file sent with the load may sit beside the version folders, e.g. the label file
    an output's label_filename names."""
    config = {"backend": "onnxruntime", "max_batch_size": 8,
              "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
              "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4], "label_filename": "labels.txt"}]}
    http.load_model("labelled", config=json.dumps(config),
                    files={"file:1/model.onnx": add_constant_model(7.0), "file:labels.txt": b"a\nb\nc\nd\n"})
    inp = httpclient.InferInput("X", [1, 4], "FP32")
    inp.set_data_from_numpy(X[:1])
    result = http.infer("labelled", [inp], outputs=[httpclient.InferRequestedOutput("Y", class_count=1)])
    top = np.argmax(X[0])
    assert result.as_numpy("Y")[0][0].decode().endswith(f":{top}:{'abcd'[top]}")
    http.unload_model("labelled")


def test_broken_model_fails_with_reason_and_others_keep_serving(server: PierProcess, http) -> None:
    with pytest.raises(InferenceServerException, match="broken") as err:
        http.load_model("broken")
    assert "version 1" in str(err.value)
    state, reason = index(server)[("broken", "1")]
    assert state == "UNAVAILABLE" and reason
    assert add_infer(http, "other")[0] == "1"



def test_a_config_that_is_not_utf8_fails_its_load_clearly(server: PierProcess, http) -> None:
    """The parse error quotes bytes that are not UTF-8: it still reaches the client (HTTP 400, gRPC
    INVALID_ARGUMENT, naming the file and line) and the repository index keeps answering."""
    with pytest.raises(InferenceServerException, match=r"config\.pbtxt:1:") as err:
        http.load_model("utf16")
    assert err.value.status() == "400"
    grpc_client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match=r"config\.pbtxt:1:") as err:
        grpc_client.load_model("utf16", client_timeout=20)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    state, reason = index(server)[("utf16", "")]
    assert state == "UNAVAILABLE" and "config.pbtxt:1:" in reason
    assert any(m.name == "utf16" for m in grpc_client.get_model_repository_index().models)
    http.unload_model("utf16")


def test_strict_readiness_counts_a_failed_load_until_it_is_unloaded(repo: Path, tmp_path: Path) -> None:
    """As Triton's strict readiness: a model asked for that failed makes the server not ready;
    unloading it (the operator gave up on it) makes the server ready again."""
    server = start_pier([repo], "--model-control-mode=explicit", "--load-model=other", log_path=tmp_path / "r.log")
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.is_server_ready()
        with pytest.raises(InferenceServerException, match="broken"):
            client.load_model("broken")  # a version fails
        assert not client.is_server_ready()
        client.unload_model("broken")
        assert index(server)[("broken", "1")] == ("UNAVAILABLE", "unloaded")
        assert client.is_server_ready()
        with pytest.raises(InferenceServerException, match="addv"):
            client.load_model("addv", config=json.dumps({"max_batch_size": "many"}))  # the model's config fails
        assert not client.is_server_ready()
        client.unload_model("addv")
        assert client.is_server_ready()
    finally:
        assert server.stop() == 0


def test_failed_reload_leaves_the_served_version_untouched(server: PierProcess, http, repo: Path) -> None:
    http.load_model("other")
    bad = {"backend": "onnxruntime", "max_batch_size": 8,
           "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [4]}],  # the model takes FP32
           "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}
    with pytest.raises(InferenceServerException, match="other"):
        http.load_model("other", config=json.dumps(bad))
    assert index(server)[("other", "1")] == ("READY", "")
    version, y = add_infer(http, "other")
    assert version == "1" and np.allclose(y, X + 10)
    # a config.pbtxt with a syntax error: the error names the file and line; v1 still serves
    config = repo / "other" / "config.pbtxt"
    good = config.read_text()
    try:
        config.write_text(good + "\nmax_batch_size: [\n")
        with pytest.raises(InferenceServerException, match=r"config.pbtxt:\d+:\d+"):
            http.load_model("other")
        assert np.allclose(add_infer(http, "other")[1], X + 10)
    finally:
        config.write_text(good)


def test_per_version_load_and_unload(server: PierProcess, http) -> None:
    base = f"{server.base()}/v2/repository/models/addv"
    http.load_model("addv")
    assert requests.post(f"{base}/versions/1/load", timeout=60).status_code == 200
    rows = index(server)
    assert rows[("addv", "1")][0] == "READY" and rows[("addv", "2")][0] == "READY"
    assert add_infer(http, "addv", "1")[0] == "1"
    assert add_infer(http, "addv")[0] == "2"  # unversioned: newest READY
    assert requests.post(f"{base}/versions/2/unload", timeout=60).status_code == 200
    assert add_infer(http, "addv")[0] == "1"
    wait_for(lambda: index(server).get(("addv", "2")) == ("UNAVAILABLE", "unloaded"), what="v2 unloaded")
    r = requests.post(f"{base}/versions/9/load", timeout=60)
    assert r.status_code == 404 and "no such version" in r.json()["error"]
    http.load_model("addv")  # a model-level load keeps the per-version choices
    assert add_infer(http, "addv")[0] == "1"
    http.unload_model("addv")  # a model-level unload clears them
    http.load_model("addv")
    assert add_infer(http, "addv")[0] == "2"


def test_per_version_load_of_a_new_folder_keeps_the_serving_version(server: PierProcess, repo: Path, http) -> None:
    """The canary pattern: v1 serves, v2 appears on disk, loading v2 by version serves both (the
    version policy alone would now pick only v2), so traffic can be split and rolled back."""
    base = f"{server.base()}/v2/repository/models/canary"
    http.load_model("canary")
    write_model(repo, "canary", None, add_constant_model(2.0), version=2)
    assert requests.post(f"{base}/versions/2/load", timeout=60).status_code == 200
    rows = index(server)
    assert rows[("canary", "1")][0] == "READY" and rows[("canary", "2")][0] == "READY"
    assert add_infer(http, "canary", "1")[0] == "1" and add_infer(http, "canary")[0] == "2"
    r = requests.post(f"{base}/rollout", json={"weights": {"1": 90, "2": 10}}, timeout=10)
    assert r.status_code == 200 and r.json()["traffic"] == {"1": 90.0, "2": 10.0}
    assert requests.post(f"{base}/rollback", timeout=10).json()["traffic"] == {"1": 100.0}
    assert add_infer(http, "canary")[0] == "1"
    http.load_model("canary")  # a model-level load keeps both
    assert {add_infer(http, "canary", v)[0] for v in ("1", "2")} == {"1", "2"}
    assert requests.post(f"{base}/versions/1/unload", timeout=60).status_code == 200
    assert requests.post(f"{base}/rollout", json={"weights": {}}, timeout=10).json()["traffic"] == {"2": 100.0}
    wait_for(lambda: index(server).get(("canary", "1")) == ("UNAVAILABLE", "unloaded"), what="v1 unloaded")
    assert add_infer(http, "canary")[0] == "2"
    http.unload_model("canary")


def test_grpc_repository_rpcs_match_http(server: PierProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.load_model("addv")
    assert client.is_model_ready("addv")
    rows = {(m.name, m.version): m.state for m in client.get_model_repository_index().models}
    assert rows[("addv", "2")] == "READY"
    assert rows == {k: v[0] for k, v in index(server).items() if k[1] or v[0]} | {
        k: "" for k, v in index(server).items() if not k[1] and not v[0]}
    client.load_model("addv", config=json.dumps({"max_batch_size": 2}))
    assert client.get_model_config("addv").config.max_batch_size == 2
    with pytest.raises(InferenceServerException, match="broken"):
        client.load_model("broken")
    client.unload_model("addv")
    wait_for(lambda: not client.is_model_ready("addv"), what="grpc unload")
    client.load_model("addv")
    client.close()


def test_racing_load_unload_end_consistent(server: PierProcess) -> None:
    base = f"{server.base()}/v2/repository/models/race"
    for round_ in range(3):
        ops = ["load", "unload"] * 6
        errors: list[str] = []

        def call(op: str, errors: list[str] = errors) -> None:
            r = requests.post(f"{base}/{op}", timeout=60)
            if r.status_code != 200:
                errors.append(f"{op}: {r.status_code} {r.text}")

        threads = [threading.Thread(target=call, args=(op,)) for op in ops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        final = "load" if round_ % 2 == 0 else "unload"
        call(final)
        client = httpclient.InferenceServerClient(server.http_url)
        if final == "load":
            assert index(server)[("race", "1")] == ("READY", "")
            assert client.is_model_ready("race")
            assert np.allclose(add_infer(client, "race")[1], X + 5)
        else:
            wait_for(lambda: index(server)[("race", "1")] == ("UNAVAILABLE", "unloaded"), what="race unloaded")
            assert not client.is_model_ready("race")
        client.close()


def test_model_cli(server: PierProcess) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pier", "model", "--url", server.http_url, *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)

    out = cli("load", "addv")
    assert out.returncode == 0, out.stderr
    listing = cli("list")
    assert listing.returncode == 0 and "MODEL" in listing.stdout
    assert any(line.split()[:3] == ["addv", "2", "READY"] for line in listing.stdout.splitlines())
    rows = json.loads(cli("--json", "list", "--ready").stdout)
    assert {"name": "addv", "version": "2", "state": "READY"} in rows
    assert all(r["state"] == "READY" for r in rows)
    assert json.loads(cli("list", "--ready", "--json").stdout) == rows  # options after the operation too
    assert cli("load", "addv", "--version", "1").returncode == 0
    doc = json.loads(cli("--json", "rollout", "addv", "--weights", "2=90,1=10").stdout)
    assert doc == {"name": "addv", "traffic": {"1": 10.0, "2": 90.0}}
    back = cli("rollback", "addv")
    assert back.returncode == 0 and back.stdout.strip() == "addv: v1 100%"
    assert cli("rollout", "addv", "--newest").stdout.strip() == "addv: v2 100%"
    assert cli("unload", "addv", "--version", "1").returncode == 0
    bad = cli("load", "broken")
    assert bad.returncode == 1 and "failed to load 'broken'" in bad.stderr
    assert cli("--url", "127.0.0.1:1", "list").returncode == 1


def test_control_calls_are_refused_outside_explicit_mode(repo: Path, tmp_path: Path) -> None:
    server = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false",
                        log_path=tmp_path / "none.log")  # mode none
    try:
        r = requests.post(f"{server.base()}/v2/repository/models/other/load", timeout=30)
        assert r.status_code == 503 and "not allowed" in r.json()["error"]
        r = requests.post(f"{server.base()}/v2/repository/models/other/versions/1/unload", timeout=30)
        assert r.status_code == 503
        assert add_infer(httpclient.InferenceServerClient(server.http_url), "other")[0] == "1"
    finally:
        assert server.stop() == 0


def test_model_warmup_runs_before_the_version_serves(server: PierProcess, http, repo: Path) -> None:
    def warmup(inputs: dict) -> str:
        return json.dumps({"max_batch_size": 8, "model_warmup": [
            {"name": "sample", "batch_size": 2, "count": 3, "inputs": inputs}]})

    good = {"X": {"data_type": "TYPE_FP32", "dims": [4], "random_data": True}}
    http.load_model("other", config=warmup(good))
    # Triton counts warmup: a batch-2 sample is 2 requests run as one execution, per run per instance
    n = sum(g["count"] for g in http.get_model_config("other")["instance_group"]) * 3
    stats = http.get_inference_statistics("other")["model_stats"][0]
    assert (stats["inference_count"], stats["execution_count"]) == (2 * n, n)
    assert stats["inference_stats"]["success"]["count"] == 2 * n and stats["last_inference"] > 0
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(2, n)]
    assert np.allclose(add_infer(http, "other")[1], X + 10)
    with pytest.raises(InferenceServerException, match="warmup sample 'sample'.*NOPE"):
        http.load_model("other", config=warmup({"NOPE": {"data_type": "TYPE_FP32", "dims": [4], "zero_data": True}}))
    with pytest.raises(InferenceServerException, match="warmup input 'X': cannot read"):
        http.load_model("other", config=warmup({"X": {"data_type": "TYPE_FP32", "dims": [4],
                                                      "input_data_file": "missing.bin"}}))
    assert np.allclose(add_infer(http, "other")[1], X + 10)  # the failed reloads left it serving
    # As Triton: an input_data_file holds one sample (the dims), which every request of the batch
    # repeats; a file shorter than a sample is refused in Triton's words.
    warm = repo / "other" / "warmup"
    warm.mkdir(exist_ok=True)
    (warm / "one.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    (warm / "short.bin").write_bytes(np.arange(2, dtype=np.float32).tobytes())
    one = {"X": {"data_type": "TYPE_FP32", "dims": [4], "input_data_file": "one.bin"}}
    http.load_model("other", config=warmup(one))
    with pytest.raises(InferenceServerException,
                       match="warmup setting expects 16 bytes, but the data provided from short.bin only has 8 bytes"):
        http.load_model("other", config=warmup({"X": {"data_type": "TYPE_FP32", "dims": [4],
                                                      "input_data_file": "short.bin"}}))
    assert np.allclose(add_infer(http, "other")[1], X + 10)
    http.load_model("other")


SLOW_CONFIG = """name: "slowm"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
"""


def test_metrics_keep_a_draining_version_until_it_unloads(server: PierProcess, http, repo: Path) -> None:
    """While a version unloads it still finishes its in-flight requests, and the metrics still show
    it (as Triton's do), so the request it finishes is counted; after the unload its series go."""
    from tests.model_builders import slow_model

    write_model(repo, "slowm", SLOW_CONFIG, slow_model(400))
    http.load_model("slowm")
    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    line = 'nv_inference_request_success{model="slowm",version="1"}'
    inp = httpclient.InferInput("X", [1, 256], "FP32")
    inp.set_data_from_numpy(np.ones((1, 256), np.float32))
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        running = pool.submit(lambda: httpclient.InferenceServerClient(server.http_url).infer("slowm", [inp]))
        time.sleep(0.3)  # it runs for seconds: unload while it is in flight
        http.unload_model("slowm")
        during = requests.get(metrics, timeout=5).text
        assert index(server)[("slowm", "1")][0] == "UNLOADING"
        running.result(timeout=60)
    assert time.monotonic() - started > 0.5  # it really was in flight
    assert line in during, "the draining version vanished from the metrics"
    wait_for(lambda: index(server).get(("slowm", "1")) == ("UNAVAILABLE", "unloaded"), what="slowm unloaded")
    assert line not in requests.get(metrics, timeout=5).text


def test_an_override_config_may_leave_out_inputs(tmp_path: Path) -> None:
    """simple_http_model_control.py: an override config replaces config.pbtxt whole, and
    {"max_batch_size": "16"} names no inputs or outputs; Triton's core accepts that (its backend
    decides), so the python model loads with it (Pier refused: 'must specify at least one input')."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tests" / "python_models" / "optional_pass", repo / "optional_pass")
    server = start_pier([repo], "--model-control-mode=explicit", log_path=tmp_path / "p.log")
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        client.load_model("optional_pass", config='{"max_batch_size":"16"}')
        assert client.get_model_config("optional_pass")["max_batch_size"] == 16
        assert client.is_model_ready("optional_pass")
    finally:
        assert server.stop() == 0
