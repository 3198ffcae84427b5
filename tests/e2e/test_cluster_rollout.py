"""A version rollout across replicas with scripts/rollout.py: two real `pier serve` "pods" (explicit
model control, each over its own copy of the repository), clients spreading requests over both as
a Service would, and the script rolling version 2 out one pod at a time (pin, load beside, READY,
smoke inference, weight steps, failure counters, unload the old version). No request may fail;
a broken version 2 on the second pod makes the script fail and roll the first pod back."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from scripts.build_example_models import _model, write_model
from tests.conftest import ROOT, PierProcess, free_port, start_pier
from tests.e2e.test_model_control import index, wait_for
from tests.e2e.test_rollout import place
from tests.model_builders import ADD_CONFIG, add_constant_model

X = np.arange(8, dtype=np.float32).reshape(2, 4)  # the clients send batches of 2; the smoke inference 1
SCRIPT = ROOT / "scripts" / "rollout.py"


def reshaping_model(rows: int) -> bytes:
    """Y = reshape(X + 2, [rows, 4]): it loads, and fails every request whose batch is not `rows`
    (a version that is broken at inference only)."""
    c = numpy_helper.from_array(np.full([4], 2.0, dtype=np.float32), "C")
    shape = numpy_helper.from_array(np.array([rows, 4], dtype=np.int64), "S")
    nodes = [helper.make_node("Add", ["X", "C"], ["s"]), helper.make_node("Reshape", ["s", "S"], ["Y"])]
    graph = helper.make_graph(nodes, "reshaping", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])], [c, shape])
    return _model(graph)


def put_version_2(repo: Path, model: bytes) -> None:
    folder = repo / "addv" / "2"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(model)


@dataclass
class Answer:
    pod: int
    sent: float
    received: float
    version: str
    correct: bool


class ServiceLoad:
    """Client threads sending unversioned requests round-robin over the pods, as a Service spreads
    them; every answer and every failure is recorded."""

    def __init__(self, pods: list[PierProcess], threads: int = 4) -> None:
        self.answers: list[Answer] = []
        self.failures: list[str] = []
        self._pods = pods
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, offset: int) -> None:
        clients = [httpclient.InferenceServerClient(p.http_url) for p in self._pods]
        inp = httpclient.InferInput("X", list(X.shape), "FP32")
        inp.set_data_from_numpy(X)
        turn = offset
        while not self._stop.is_set():
            pod = turn % len(clients)
            turn += 1
            sent = time.monotonic()
            try:
                result = clients[pod].infer("addv", [inp])
            except Exception as exc:  # every failure is a test failure
                with self._lock:
                    self.failures.append(f"pod {pod}: {exc}")
                continue
            version = result.get_response()["model_version"]
            correct = np.allclose(result.as_numpy("Y"), X + float(version))
            with self._lock:
                self.answers.append(Answer(pod, sent, time.monotonic(), version, correct))
            time.sleep(0.002)  # a steady load that leaves the shared CPUs to the servers and the script
        for c in clients:
            c.close()

    def __enter__(self) -> ServiceLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def since(self, t: float) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if a.sent >= t]

    def wait_answers(self, t: float, per_pod: int = 20, timeout: float = 60) -> list[Answer]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.since(t)
            if all(sum(1 for a in got if a.pod == p) >= per_pod for p in range(len(self._pods))):
                return got
            time.sleep(0.05)
        raise AssertionError(f"fewer than {per_pod} answers per pod after {timeout}s")


def rollout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)


def pod_args(pods: list[PierProcess]) -> list[str]:
    return ["--pods", ",".join(p.base() for p in pods),
            "--metrics", ",".join(f"http://127.0.0.1:{p.metrics_port}" for p in pods)]


def infer_version(pod: PierProcess) -> str:
    client = httpclient.InferenceServerClient(pod.http_url)
    inp = httpclient.InferInput("X", list(X.shape), "FP32")
    inp.set_data_from_numpy(X)
    try:
        return client.infer("addv", [inp]).get_response()["model_version"]
    finally:
        client.close()


def traffic(pod: PierProcess) -> dict[str, float]:
    return requests.get(f"{pod.base()}/v2/repository/models/addv/traffic", timeout=10).json()["traffic"]


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[tuple[list[PierProcess], list[Path]]]:
    """Two pods serving `addv` version 1 (version policy latest 1), each over its own repository copy."""
    repos, pods = [], []
    try:
        for i in range(2):
            repo = tmp_path / f"pod{i}" / "repo"
            write_model(repo, "addv", ADD_CONFIG.format(name="addv", policy="{ latest { num_versions: 1 } }"),
                        add_constant_model(1.0))
            repos.append(repo)
            pods.append(start_pier([repo], "--model-control-mode=explicit", "--load-model=addv",
                                   log_path=tmp_path / f"pod{i}.log"))
        yield pods, repos
    finally:
        for pod in pods:
            assert pod.stop() == 0, pod.log()


def test_rollout_across_two_pods_drops_no_request(cluster: tuple[list[PierProcess], list[Path]],
                                                  tmp_path: Path) -> None:
    pods, repos = cluster
    for i, repo in enumerate(repos):
        place(repo, tmp_path / f"staging{i}", "addv", 2, 2.0)
    # refusals change nothing: an unknown model; the dry run prints the plan and checks the pods
    done = rollout("nope", "--version", "2", *pod_args(pods))
    assert done.returncode == 2 and "refused, nothing changed" in done.stderr and "'nope'" in done.stderr
    done = rollout("addv", "--version", "newest", "--repository", str(repos[0]), "--dry-run", *pod_args(pods))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "roll out 'addv' version 2 to 2 pod(s)" in done.stdout and "dry run: 2 pod(s) to roll out" in done.stdout
    assert all(("addv", "2") not in index(p) and traffic(p) == {"1": 100.0} for p in pods)

    with ServiceLoad(pods) as load:
        start = time.monotonic()
        assert {a.version for a in load.wait_answers(start)} == {"1"}
        done = rollout("addv", "--version", "2", "--steps", "50,100", "--step-wait", "0.3", "--smoke-data",
                       "random", *pod_args(pods))
        end = time.monotonic()
        after = load.wait_answers(end)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done: 'addv' version 2 serves on all 2 pod(s)" in done.stdout
    assert load.failures == [], load.failures[:5]
    assert load.answers and all(a.correct for a in load.answers), "an answer did not match its version"
    assert {a.version for a in after} == {"2"}
    # one pod at a time: the second pod answered with version 2 only after the first stopped using version 1
    during = load.since(start)
    last_v1_first = max(a.received for a in during if a.pod == 0 and a.version == "1")
    first_v2_second = min(a.sent for a in during if a.pod == 1 and a.version == "2")
    assert first_v2_second > last_v1_first
    for pod in pods:
        assert infer_version(pod) == "2" and traffic(pod) == {"2": 100.0}
        wait_for(lambda p=pod: index(p).get(("addv", "1")) == ("UNAVAILABLE", "unloaded"), what="v1 unloaded")
        assert requests.get(f"{pod.base()}/v2/models/addv", timeout=10).json()["versions"] == ["2"]
        assert requests.get(f"{pod.base()}/v2/health/ready", timeout=10).status_code == 200
    # run again: nothing to do
    again = rollout("addv", "--version", "2", *pod_args(pods))
    assert again.returncode == 0 and again.stdout.count("already serves 'addv' version 2 only") == 2


@pytest.mark.parametrize("broken, message, unload_old", [
    # --unload-old each: the first pod's version 1 is gone when the second fails; the rollback reloads it
    (b"this is not an onnx model", "POST /v2/repository/models/addv/versions/2/load answered 400", "each"),
    (reshaping_model(3), "smoke inference failed", "end"),  # loads, fails every request: the smoke inference
], ids=["corrupt-file", "fails-at-inference"])
def test_a_broken_version_on_the_second_pod_rolls_the_first_back(cluster: tuple[list[PierProcess], list[Path]],
                                                                 tmp_path: Path, broken: bytes, message: str,
                                                                 unload_old: str) -> None:
    pods, repos = cluster
    place(repos[0], tmp_path / "staging0", "addv", 2, 2.0)
    put_version_2(repos[1], broken)  # the second pod's copy of version 2 is broken

    with ServiceLoad(pods) as load:
        start = time.monotonic()
        load.wait_answers(start)
        done = rollout("addv", "--version", "2", "--steps", "50,100", "--step-wait", "0.3", "--unload-old",
                       unload_old, *pod_args(pods))
        end = time.monotonic()
        after = load.wait_answers(end)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"FAILED: {pods[1].base()}" in done.stderr or f"FAILED: smoke inference failed: {pods[1].base()}" \
        in done.stderr, done.stderr
    assert message in done.stderr and "rolled back: every pod serves what it served before" in done.stderr
    # the broken version took no client request: pinned traffic until it passed the smoke inference
    assert load.failures == [], load.failures[:5]
    assert load.answers and all(a.correct for a in load.answers), "an answer did not match its version"
    assert any(a.pod == 0 and a.version == "2" for a in load.since(start)), "the first pod never served v2"
    assert {a.version for a in after} == {"1"}
    for pod in pods:
        assert infer_version(pod) == "1" and traffic(pod) == {"1": 100.0}
        wait_for(lambda p=pod: index(p).get(("addv", "2"), ("", ""))[1] == "unloaded", what="v2 unloaded")
        # strict readiness: a failed load counts against the pod until the script unloads it
        assert requests.get(f"{pod.base()}/v2/health/ready", timeout=10).status_code == 200


def test_failures_under_real_traffic_stop_the_rollout_at_the_first_step(
        cluster: tuple[list[PierProcess], list[Path]]) -> None:
    """Version 2 passes the smoke inference (batch 1) but fails the clients' batches of 2: the
    failure counters catch it at the 10 % step on the first pod, which goes back to version 1; the
    second pod is never touched. Only that step's share of the first pod's requests fail."""
    pods, repos = cluster
    for repo in repos:
        put_version_2(repo, reshaping_model(1))
    with ServiceLoad(pods) as load:
        start = time.monotonic()
        load.wait_answers(start)
        done = rollout("addv", "--version", "2", "--steps", "10,100", "--step-wait", "1", *pod_args(pods))
        after = load.wait_answers(time.monotonic())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "smoke inference on version 2 ok" in done.stdout and "traffic v1 90%, v2 10%" in done.stdout
    assert f"{pods[0].base()}: nv_inference_request_failure of 'addv' grew" in done.stderr
    assert "reason=BACKEND,version=2" in done.stderr and "traffic v2 100%" not in done.stdout
    assert load.failures and all(f.startswith("pod 0:") for f in load.failures), load.failures[:5]
    served_by_pod0 = sum(1 for a in load.since(start) if a.pod == 0)
    assert len(load.failures) < served_by_pod0 / 3, (len(load.failures), served_by_pod0)
    assert {a.version for a in after} == {"1"} and all(a.correct for a in load.answers)
    assert infer_version(pods[0]) == "1" and traffic(pods[0]) == {"1": 100.0}
    assert ("addv", "2") not in index(pods[1]) and pods[1].base() not in done.stderr.split("rolling back")[1]


SLOW_WARMUP = ('model_warmup [ { name: "slow" batch_size: 1 count: 40000 inputs { key: "X" value { '
               'data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } } ]\n')


@pytest.mark.slow
def test_a_load_slower_than_the_load_call_timeout_is_waited_for(cluster: tuple[list[PierProcess], list[Path]],
                                                                 tmp_path: Path) -> None:
    """The load call gives up after 0.3 s (as a proxy's idle timeout would) while the server goes on
    warming version 2 up for a second or two: the script waits for READY before the smoke inference."""
    pods, repos = cluster
    for i, repo in enumerate(repos):
        place(repo, tmp_path / f"staging{i}", "addv", 2, 2.0)
        config = repo / "addv" / "config.pbtxt"  # read at the next load (version 1 reloads with it, safely)
        config.write_text(config.read_text() + SLOW_WARMUP)
    smoke = tmp_path / "smoke.json"
    smoke.write_text(json.dumps({"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}))
    with ServiceLoad(pods) as load:
        load.wait_answers(time.monotonic())
        done = rollout("addv", "--version", "2", "--steps", "100", "--step-wait", "0.2", "--load-timeout", "0.3",
                       "--smoke-request", str(smoke), *pod_args(pods))
        after = load.wait_answers(time.monotonic())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("the load call did not answer within 0.3 s") == 2
    assert load.failures == [], load.failures[:5]
    assert {a.version for a in after} == {"2"} and all(a.correct for a in load.answers)


def kube_pod(name: str, ip: str, phase: str = "Running", ready: bool = True, deleting: bool = False) -> dict:
    meta: dict = {"name": name, **({"deletionTimestamp": "2025-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip,
                                         "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_kubectl_selector_lists_the_running_pods(tmp_path: Path) -> None:
    """--kubectl-selector with a stand-in kubectl: Running pods in name order, terminating and
    Pending ones skipped, a Running pod that is not Ready refuses the rollout."""
    port = free_port()  # nothing listens there: the dry run's checks fail fast, after the plan
    args_file, pods_file = tmp_path / "args", tmp_path / "pods.json"
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(f'#!/bin/sh\necho "$@" > {args_file}\ncat {pods_file}\n')
    kubectl.chmod(0o755)
    pods_file.write_text(json.dumps({"items": [
        kube_pod("pier-b", "127.0.0.2"), kube_pod("pier-a", "127.0.0.1"),
        kube_pod("pier-c", "127.0.0.3", deleting=True), kube_pod("pier-d", "", phase="Pending", ready=False)]}))
    done = rollout("addv", "--version", "2", "--kubectl-selector", "app.kubernetes.io/name=pier", "--namespace",
                   "serving", "--kubectl", str(kubectl), "--port", str(port), "--dry-run", "--timeout", "2")
    assert args_file.read_text().split() == ["get", "pods", "-o", "json", "-l", "app.kubernetes.io/name=pier",
                                             "-n", "serving"]
    assert f"pod 1/2 pier-a (http://127.0.0.1:{port}):" in done.stdout
    assert f"pod 2/2 pier-b (http://127.0.0.2:{port}):" in done.stdout and "pier-c" not in done.stdout
    assert done.returncode == 2 and "dry run: the rollout would be refused" in done.stderr
    pods_file.write_text(json.dumps({"items": [kube_pod("pier-a", "127.0.0.1", ready=False)]}))
    done = rollout("addv", "--version", "2", "--kubectl-selector", "app=pier", "--kubectl", str(kubectl))
    assert done.returncode == 2 and "pod pier-a is Running but not Ready" in done.stderr
