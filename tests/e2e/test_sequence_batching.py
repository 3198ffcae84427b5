"""Triton's sequence batcher through the real server, a real ONNX stateful model and the real
clients: control inputs (START, END, READY, CORRID), implicit state kept by the server between a
sequence's requests, sequences batched together, and Triton's refusals (checked against the
reference Triton 2.51: same messages, same cases)."""

from __future__ import annotations

import os
import queue
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from scripts.build_example_models import ACCUMULATE_CONFIG, accumulate_model, write_model
from tests.conftest import start_pier

pytestmark = pytest.mark.frontends  # sequence ids and flags cross the channel

# The example model, with a short idle limit (for the release test) and room to batch: a batch
# waits up to 3 ms for half its slots to hold a ready request.
CONFIG = ACCUMULATE_CONFIG.replace("idle_microseconds: 60000000", "idle_microseconds: 700000").replace(
    "max_queue_delay_microseconds: 1000", "max_queue_delay_microseconds: 3000 minimum_slot_utilization: 0.5")
assert "700000" in CONFIG and "0.5 }" in CONFIG


# A stateful python model as Triton's dyna_sequence backend is: each instance keeps its sequences'
# sums itself, in a dict keyed by CORRID, so a request reaching another instance than its sequence's
# gets a wrong sum. Two instances; INSTANCE says which one answered.
INSTANCE_SUM = """name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "INSTANCE" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 5000000
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  {strategy}
}}
"""
INSTANCE_SUM_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"].encode()
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value, start, end, corrid = (pb_utils.get_input_tensor_by_name(request, n).as_numpy()
                                         for n in ("INPUT", "START", "END", "CORRID"))
            out = np.zeros_like(value)
            for row in range(value.shape[0]):
                key = int(corrid[row, 0])
                out[row, 0] = self.sums[key] = (0 if start[row, 0] else self.sums.get(key, 0)) + int(value[row, 0])
                if end[row, 0]:
                    del self.sums[key]
            names = np.array([[self.name]] * value.shape[0], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out),
                                                         pb_utils.Tensor("INSTANCE", names)]))
        return responses
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("seq") / "repo"
    write_model(repo, "accumulate", CONFIG, accumulate_model())
    bad = CONFIG.replace('name: "accumulate"', 'name: "bad_control"').replace("int32_false_true: [ 0, 1 ]", "")
    write_model(repo, "bad_control", bad, accumulate_model())
    init = CONFIG.replace('name: "accumulate"', 'name: "init_file"').replace(
        "dims: [ 1 ] } ]\n  direct",
        'dims: [ 1 ] initial_state [ { data_type: TYPE_FP32 dims: [ 1 ] data_file: "ten.bin" name: "ten" } ] } ]'
        "\n  direct")
    folder = write_model(repo, "init_file", init, accumulate_model())
    (folder / "initial_state").mkdir()
    (folder / "initial_state" / "ten.bin").write_bytes(np.array([10.0], np.float32).tobytes())
    corr32 = CONFIG.replace('name: "accumulate"', 'name: "corr32"').replace("TYPE_UINT64", "TYPE_INT32")
    write_model(repo, "corr32", corr32, accumulate_model("INT32"))
    auto = CONFIG.replace('name: "accumulate"', 'name: "auto_io"').split("sequence_batching")[1]
    write_model(repo, "auto_io", 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\nsequence_batching' + auto,
                accumulate_model())
    for name, direct in (("long_delay", "direct { max_queue_delay_microseconds: 5000000 }"),
                         ("full_slots", "direct { max_queue_delay_microseconds: 400000 minimum_slot_utilization: 1 }"),
                         ("four_slots", "direct { max_queue_delay_microseconds: 500000 minimum_slot_utilization: 1 }")):
        config = CONFIG.replace('name: "accumulate"', f'name: "{name}"').replace(
            "direct { max_queue_delay_microseconds: 3000 minimum_slot_utilization: 0.5 }", direct)
        assert direct in config
        if name == "four_slots":
            config = config.replace("max_batch_size: 8", "max_batch_size: 4")
        write_model(repo, name, config, accumulate_model())
    for name, strategy in (("instance_sum_direct", "direct { max_queue_delay_microseconds: 1000 }"),
                           ("instance_sum_oldest",
                            "oldest { max_candidate_sequences: 16 max_queue_delay_microseconds: 1000 }"),
                           ("instance_sum_killed", "direct { }")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(INSTANCE_SUM.format(name=name, strategy=strategy))
        (repo / name / "1" / "model.py").write_text(INSTANCE_SUM_PY)
    proc = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false", log_path=repo.parent / "pier.log")
    yield proc
    assert proc.stop() == 0, proc.log()


def http_step(client: httpclient.InferenceServerClient, seq, value: float, **flags) -> dict:
    i = httpclient.InferInput("INPUT", [1, 1], "FP32")
    i.set_data_from_numpy(np.array([[value]], np.float32))
    r = client.infer("accumulate", [i], sequence_id=seq, **flags)
    return {n: r.as_numpy(n) for n in ("OUTPUT", "CTRL", "CORR_OUT", "STATE_SEEN")}


def test_state_controls_and_correlation_ids(server) -> None:
    h = httpclient.InferenceServerClient(server.http_url)
    a = http_step(h, 41, 1.0, sequence_start=True)
    b = http_step(h, 42, 100.0, sequence_start=True)  # interleaved: each sequence keeps its own state
    assert a["OUTPUT"].tolist() == [[1.0]] and b["OUTPUT"].tolist() == [[100.0]]
    assert a["CTRL"].tolist() == [[1.0, 0.0, 1.0]] and a["CORR_OUT"].tolist() == [[41]]
    assert a["STATE_SEEN"].tolist() == [[0.0]]  # no initial_state configured: zeros
    a = http_step(h, 41, 2.0)
    assert a["OUTPUT"].tolist() == [[3.0]] and a["CTRL"].tolist() == [[0.0, 0.0, 1.0]]
    assert a["STATE_SEEN"].tolist() == [[1.0]]
    b = http_step(h, 42, 5.0, sequence_end=True)
    assert b["OUTPUT"].tolist() == [[105.0]] and b["CTRL"].tolist() == [[0.0, 1.0, 1.0]]
    assert b["CORR_OUT"].tolist() == [[42]]
    a = http_step(h, 41, 4.0, sequence_start=True)  # START again restarts the sequence from its initial state
    assert a["OUTPUT"].tolist() == [[4.0]] and a["STATE_SEEN"].tolist() == [[0.0]]
    g = grpcclient.InferenceServerClient(server.grpc_url)  # gRPC, string correlation ID
    for value, expected, flags in ((1.0, 1.0, {"sequence_start": True}), (2.0, 3.0, {}),
                                   (3.0, 6.0, {"sequence_end": True})):
        i = grpcclient.InferInput("INPUT", [1, 1], "FP32")
        i.set_data_from_numpy(np.array([[value]], np.float32))
        r = g.infer("accumulate", [i], sequence_id="session-a", **flags)
        assert r.as_numpy("OUTPUT").tolist() == [[expected]]
        assert r.as_numpy("STATE_OUT") is None  # implicit state stays in the server
    assert "sequence" in g.get_server_metadata().extensions


def test_concurrent_sequences_batch_and_stay_apart(server) -> None:
    before = requests.get(f"{server.base()}/v2/models/accumulate/stats", timeout=10).json()["model_stats"][0]

    def run(seq: int) -> list[float]:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        sums = []
        for k in range(6):
            i = grpcclient.InferInput("INPUT", [1, 1], "FP32")
            i.set_data_from_numpy(np.array([[float(seq * 10 + k)]], np.float32))
            r = client.infer("accumulate", [i], sequence_id=seq, sequence_start=k == 0, sequence_end=k == 5)
            sums.append(float(r.as_numpy("OUTPUT")[0, 0]))
        return sums

    with ThreadPoolExecutor(8) as pool:
        results = dict(zip(range(1, 9), pool.map(run, range(1, 9))))
    for seq, sums in results.items():
        assert sums == list(np.cumsum([seq * 10 + k for k in range(6)]).astype(float)), (seq, sums)
    after = requests.get(f"{server.base()}/v2/models/accumulate/stats", timeout=10).json()["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 48
    assert after["execution_count"] - before["execution_count"] < 48  # sequences shared batches


def test_grpc_stream_sequence(server) -> None:
    g = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    g.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for k, value in enumerate((2.0, 3.0, 4.0)):
            i = grpcclient.InferInput("INPUT", [1, 1], "FP32")
            i.set_data_from_numpy(np.array([[value]], np.float32))
            g.async_stream_infer("accumulate", [i], request_id=str(k), sequence_id=77, sequence_start=k == 0,
                                 sequence_end=k == 2)
        got = [answers.get(timeout=10) for _ in range(3)]
    finally:
        g.stop_stream()
    assert all(e is None for _, e in got), got
    assert sorted(float(r.as_numpy("OUTPUT")[0, 0]) for r, _ in got) == [2.0, 5.0, 9.0]


def test_sequences_a_model_keys_by_corrid_stay_apart_in_shared_batches(tmp_path) -> None:
    """The client examples' -d runs (simple_grpc_sequence_stream_infer_client.py): interleaved
    sequences with string IDs share batches of a model that keeps each one's sum under the CORRID
    its row carries; every answer must be its own sequence's."""
    import shutil
    from pathlib import Path

    repo = tmp_path / "repo"
    shutil.copytree(Path(__file__).resolve().parents[1] / "python_models" / "dyna_sequence_py",
                    repo / "dyna_sequence_py")
    proc = start_pier([repo], log_path=tmp_path / "pier.log")
    values = [11, 7, 5, 3, 2, 0, 1]
    sequences = {"1000": [0, *values], "1001": [100, *(-v for v in values)], "1002": [20, *(-v for v in values)]}
    g = grpcclient.InferenceServerClient(proc.grpc_url)
    answers: queue.Queue = queue.Queue()
    g.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for k in range(len(values) + 1):  # one request of each sequence in turn
            for seq, sent in sequences.items():
                i = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                i.set_data_from_numpy(np.array([[sent[k]]], np.int32))
                g.async_stream_infer("dyna_sequence_py", [i], request_id=f"{seq}:{k}", sequence_id=seq,
                                     sequence_start=k == 0, sequence_end=k == len(values))
        got: dict[str, dict[int, int]] = {seq: {} for seq in sequences}
        for _ in range(3 * (len(values) + 1)):
            result, error = answers.get(timeout=30)
            assert error is None, error
            seq, k = result.get_response().id.split(":")
            got[seq][int(k)] = int(result.as_numpy("OUTPUT")[0, 0])
    finally:
        g.stop_stream()
        assert proc.stop() == 0
    for seq, sent in sequences.items():
        expected = list(np.cumsum(sent))
        expected[-1] += int(seq)
        assert [got[seq][k] for k in range(len(sent))] == expected, (seq, got[seq])


def infer_json(server, params: dict | None, rows: int = 1) -> requests.Response:
    body: dict = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [rows, 1], "data": [1.0] * rows}]}
    if params is not None:
        body["parameters"] = params
    return requests.post(f"{server.base()}/v2/models/accumulate/infer", json=body, timeout=30)


def test_refusals_as_triton(server) -> None:
    no_id = "inference request to model 'accumulate' must specify a non-zero or non-empty correlation ID"
    not_started = ("inference request for sequence {} to model 'accumulate' must specify the START flag on the "
                   "first request of the sequence")
    for params in (None, {"sequence_id": 0}, {"sequence_id": "", "sequence_start": True}):
        r = infer_json(server, params)
        assert r.status_code == 400 and r.json()["error"] == no_id, (params, r.text)
    r = infer_json(server, {"sequence_id": 9})
    assert r.status_code == 400 and r.json()["error"] == not_started.format(9)
    r = infer_json(server, {"sequence_id": 9, "sequence_start": True}, rows=2)
    assert r.status_code == 400
    assert r.json()["error"] == ("inference request to model 'accumulate' must specify batch-size 1 due to "
                                 "requirements of sequence batcher")
    assert infer_json(server, {"sequence_id": 9, "sequence_start": True, "sequence_end": True}).status_code == 200
    r = infer_json(server, {"sequence_id": 9})  # ended: the next request must START again
    assert r.status_code == 400 and r.json()["error"] == not_started.format(9)
    assert infer_json(server, {"sequence_id": 10, "sequence_start": True}).status_code == 200
    time.sleep(1.0)  # past max_sequence_idle_microseconds (0.7 s): the sequence is released
    r = infer_json(server, {"sequence_id": 10})
    assert r.status_code == 400 and r.json()["error"] == not_started.format(10)
    r = infer_json(server, {"sequence_id": -3, "sequence_start": True})
    assert r.status_code == 400 and "sequence_id" in r.json()["error"]


def test_narrow_corrid_wraps_as_triton(server) -> None:
    """An INT32 CORRID gets the ID cast as Triton casts it (2^31 -> -2^31, 2^33 + 5 -> 5); a string
    ID gets a stable 32-bit value. Before, these were 500s."""
    h = httpclient.InferenceServerClient(server.http_url)
    for seq, expected in ((2**31, -2**31), (2**33 + 5, 5), (12, 12)):
        i = httpclient.InferInput("INPUT", [1, 1], "FP32")
        i.set_data_from_numpy(np.array([[1.0]], np.float32))
        r = h.infer("corr32", [i], sequence_id=seq, sequence_start=True, sequence_end=True)
        assert r.as_numpy("CORR_OUT").tolist() == [[expected]], seq
    for _ in range(2):
        i = httpclient.InferInput("INPUT", [1, 1], "FP32")
        i.set_data_from_numpy(np.array([[1.0]], np.float32))
        r = h.infer("corr32", [i], sequence_id="s1", sequence_start=True, sequence_end=True)
        assert r.as_numpy("CORR_OUT").dtype == np.int32


def test_initial_state_from_a_data_file(server) -> None:
    h = httpclient.InferenceServerClient(server.http_url)
    for value, seen, flags in ((1.0, 10.0, {"sequence_start": True}), (2.0, 1.0, {})):
        i = httpclient.InferInput("INPUT", [1, 1], "FP32")
        i.set_data_from_numpy(np.array([[value]], np.float32))
        r = h.infer("init_file", [i], sequence_id=3, **flags)
        assert r.as_numpy("STATE_SEEN").tolist() == [[seen]]


def test_auto_complete_leaves_controls_and_state_to_the_batcher(server) -> None:
    cfg = requests.get(f"{server.base()}/v2/models/auto_io/config", timeout=10).json()
    assert [t["name"] for t in cfg["input"]] == ["INPUT"]
    assert [t["name"] for t in cfg["output"]] == ["OUTPUT", "CTRL", "CORR_OUT", "STATE_SEEN"]
    h = httpclient.InferenceServerClient(server.http_url)
    i = httpclient.InferInput("INPUT", [1, 1], "FP32")
    i.set_data_from_numpy(np.array([[2.5]], np.float32))
    r = h.infer("auto_io", [i], sequence_id=1, sequence_start=True)
    assert r.as_numpy("OUTPUT").tolist() == [[2.5]]


def test_config_normalised_and_bad_control_refused(server) -> None:
    cfg = requests.get(f"{server.base()}/v2/models/accumulate/config", timeout=10).json()
    assert cfg["sequence_batching"]["max_sequence_idle_microseconds"] == 700000
    assert [c["name"] for c in cfg["sequence_batching"]["control_input"]] == ["START", "END", "READY", "CORRID"]
    index = {m["name"]: m for m in requests.post(f"{server.base()}/v2/repository/index", timeout=10).json()}
    assert index["bad_control"]["state"] == "UNAVAILABLE"
    assert "config.pbtxt" in index["bad_control"]["reason"]
    assert "'START' (START) must give exactly two false/true values" in index["bad_control"]["reason"]


def test_many_threads_one_sequence_run_in_order(server) -> None:
    """Requests of one sequence sent back to back without waiting run one at a time, in order."""
    h = httpclient.InferenceServerClient(server.http_url, concurrency=4)
    http_step(h, 500, 0.0, sequence_start=True)
    futures = []
    for _ in range(8):
        i = httpclient.InferInput("INPUT", [1, 1], "FP32")
        i.set_data_from_numpy(np.array([[1.0]], np.float32))
        futures.append(h.async_infer("accumulate", [i], sequence_id=500))
    outs = [float(f.get_result().as_numpy("OUTPUT")[0, 0]) for f in futures]
    assert sorted(outs) == [float(k) for k in range(1, 9)]


def test_direct_strategy_waits_only_for_empty_slots(server) -> None:
    """Triton's direct strategy: a batch runs once `minimum_slot_utilization` of its slots hold a
    ready request (default 0: one is enough), so a lone sequence never waits out
    max_queue_delay_microseconds; with every slot required, it does."""
    h = httpclient.InferenceServerClient(server.http_url)

    def one(model: str, seq: int) -> float:
        i = httpclient.InferInput("INPUT", [1, 1], "FP32")
        i.set_data_from_numpy(np.array([[1.0]], np.float32))
        start = time.perf_counter()
        h.infer(model, [i], sequence_id=seq, sequence_start=True, sequence_end=True)
        return time.perf_counter() - start

    assert one("long_delay", 1) < 2.5  # a 5 s delay, not waited
    assert one("full_slots", 2) >= 0.35  # 1 of 8 slots ready: waits the 0.4 s delay


def test_sequence_requests_waiting_their_turn_are_pending_and_wait_the_delay_afresh(server) -> None:
    """qa/L0_metrics (metrics_queue_size_test, sequence direct/oldest), as Triton 2.51: a request
    queued behind its sequence's earlier request counts in nv_inference_pending_request_count, and
    once its turn comes it waits max_queue_delay_microseconds for full slots from then (it ran
    alone at once, having 'waited' since it arrived). Three sequences, two requests each, 4 slots
    all required: two batches of three, each after the 0.5 s delay."""
    model = "four_slots"
    base = server.base()
    before = requests.get(f"{base}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]
    h = httpclient.InferenceServerClient(server.http_url, concurrency=6)
    futures = []
    t0 = time.perf_counter()
    for step in range(2):
        for seq in (71, 72, 73):
            i = httpclient.InferInput("INPUT", [1, 1], "FP32")
            i.set_data_from_numpy(np.array([[1.0]], np.float32))
            futures.append(h.async_infer(model, [i], sequence_id=seq, sequence_start=step == 0,
                                         sequence_end=step == 1))
    time.sleep(0.25)  # the first three wait for a fourth slot, the second three for their turn
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    line = next(m for m in metrics.splitlines()
                if m.startswith(f'nv_inference_pending_request_count{{model="{model}"'))
    assert line.endswith(" 6"), line
    outs = [float(f.get_result().as_numpy("OUTPUT")[0, 0]) for f in futures]
    elapsed = time.perf_counter() - t0
    assert outs == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    after = requests.get(f"{base}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]
    assert after["execution_count"] - before["execution_count"] == 2
    assert elapsed >= 0.95  # the second batch waited its own 0.5 s


def sum_step(client, seq: int, value: int, **flags) -> tuple[int, str]:
    """One request of a sequence to instance_sum_* (client: HTTP or gRPC): its sum and its instance."""
    model = flags.pop("model")
    mod = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    i = mod.InferInput("INPUT", [1, 1], "INT32")
    i.set_data_from_numpy(np.array([[value]], np.int32))
    r = client.infer(model, [i], sequence_id=seq, **flags)
    return int(r.as_numpy("OUTPUT")[0, 0]), r.as_numpy("INSTANCE")[0, 0].decode()


@pytest.mark.parametrize("model", ["instance_sum_direct", "instance_sum_oldest"])
def test_a_model_keeping_state_per_instance_sees_all_of_a_sequence(server, model: str) -> None:
    """Triton's promise: every request of a sequence goes to the same instance. 24 sequences at once
    (more than the 16 slots of the direct strategy: the rest wait for one), half over gRPC, half over
    HTTP, 6 requests each; a model with two instances keeps each sum in the instance: every sum is
    right, each sequence was answered by one instance, and both instances served."""
    def run(seq: int) -> tuple[list[int], set[str]]:
        client = (grpcclient.InferenceServerClient(server.grpc_url) if seq % 2
                  else httpclient.InferenceServerClient(server.http_url))
        sums, where = [], set()
        for k in range(6):
            total, instance = sum_step(client, seq, seq + k, model=model, sequence_start=k == 0, sequence_end=k == 5)
            sums.append(total)
            where.add(instance)
        return sums, where

    with ThreadPoolExecutor(24) as pool:
        results = dict(zip(range(1, 25), pool.map(run, range(1, 25))))
    for seq, (sums, where) in results.items():
        assert sums == list(np.cumsum([seq + k for k in range(6)])), (seq, sums, where)
        assert len(where) == 1, (seq, where)
    assert {w for _, (_, where) in results.items() for w in where} == {f"{model}_0_0", f"{model}_0_1"}


def test_the_sequences_of_a_stub_that_died_are_over(server) -> None:
    """kill -9 of one instance's stub: its sequences' next requests without START get Triton's error
    (their state died with it), the other instance's sequences go on with the right sums, and new
    sequences run once it has restarted."""
    from tests.e2e.test_python_process import stubs

    model = "instance_sum_killed"
    h = httpclient.InferenceServerClient(server.http_url)
    placed = {seq: sum_step(h, seq, 1, model=model, sequence_start=True)[1] for seq in range(1, 5)}
    assert set(placed.values()) == {f"{model}_0_0", f"{model}_0_1"}, placed  # the lowest slot of each first
    victim = placed[1]
    restarted = server.log().count(f"Stub process for model '{model}' instance '{victim}' restarted")
    os.kill(stubs(server.proc.pid)[victim], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server.log().count(f"Stub process for model '{model}' instance '{victim}' restarted") == restarted:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    for seq, instance in placed.items():
        if instance == victim:
            r = infer_sum(server, model, {"sequence_id": seq})
            assert r.status_code == 400, r.text
            assert r.json()["error"] == (f"inference request for sequence {seq} to model '{model}' must specify "
                                         "the START flag on the first request of the sequence")
        else:
            assert sum_step(h, seq, 2, model=model, sequence_end=True) == (3, instance)
    for seq in (5, 6, 7):
        assert sum_step(h, seq, 4, model=model, sequence_start=True)[0] == 4
        assert sum_step(h, seq, 5, model=model, sequence_end=True)[0] == 9


def infer_sum(server, model: str, params: dict) -> requests.Response:
    body = {"inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}], "parameters": params}
    return requests.post(f"{server.base()}/v2/models/{model}/infer", json=body, timeout=30)
