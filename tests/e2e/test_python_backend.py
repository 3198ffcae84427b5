"""Python models written only against Triton's documented python-backend API
(tests/python_models/) serve unchanged: plain execute, BLS (sync and async_exec), decoupled
streaming over gRPC ModelStreamInfer, errors that fail only their own request, and dynamic
batching handing execute() a list of requests."""

from __future__ import annotations

import json
import queue
import shutil
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, ROOT, PierProcess, numpy_inputs, start_pier

PY_MODELS = ROOT / "tests" / "python_models"


# An ensemble with a decoupled step (Triton marks it decoupled): each response of square_int32
# goes on through double_int32 and out as one ensemble response.
SQUARE_DOUBLE = """name: "square_double"
platform: "ensemble"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "DOUBLED" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "square_int32" input_map { key: "IN" value: "N" } output_map { key: "OUT" value: "n" } },
  { model_name: "double_int32" input_map { key: "IN" value: "n" } output_map { key: "OUT" value: "DOUBLED" } }
] }
"""


# One step that reports the parameters it was given (Triton's parameter-forwarding qa case).
ARGS_ENSEMBLE = """name: "args_ensemble"
platform: "ensemble"
max_batch_size: 0
input [ { name: "MODEL" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "request_args_py" input_map { key: "MODEL" value: "MODEL" } output_map { key: "ARGS" value: "ARGS" } }
] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("py") / "repo"
    shutil.copytree(PY_MODELS, repo)
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    (repo / "square_double" / "1").mkdir(parents=True)
    (repo / "square_double" / "config.pbtxt").write_text(SQUARE_DOUBLE)
    (repo / "args_ensemble" / "1").mkdir(parents=True)
    (repo / "args_ensemble" / "config.pbtxt").write_text(ARGS_ENSEMBLE)
    # the iterative model with a scheduler that cannot reschedule (Triton's unsupported case)
    shutil.copytree(repo / "iterative_countdown", repo / "reschedule_dynamic")
    config = (repo / "reschedule_dynamic" / "config.pbtxt").read_text()
    (repo / "reschedule_dynamic" / "config.pbtxt").write_text(
        config.replace('"iterative_countdown"', '"reschedule_dynamic"')
        .replace("sequence_batching { iterative_sequence: true }", "dynamic_batching { }"))
    # the iterative model with two instances: a rescheduled request must come back to its own
    shutil.copytree(repo / "iterative_countdown", repo / "iterative_countdown_2")
    config = (repo / "iterative_countdown_2" / "config.pbtxt").read_text()
    (repo / "iterative_countdown_2" / "config.pbtxt").write_text(
        config.replace('"iterative_countdown"', '"iterative_countdown_2"').replace("count: 1", "count: 2"))
    # the same decoupled model in the server's own process (its sends and its result take no channel)
    shutil.copytree(repo / "send_then_fail", repo / "send_then_fail_inproc")
    config = (repo / "send_then_fail_inproc" / "config.pbtxt").read_text()
    (repo / "send_then_fail_inproc" / "config.pbtxt").write_text(
        config.replace('"send_then_fail"', '"send_then_fail_inproc"')
        + 'parameters { key: "execution_mode" value: { string_value: "in_process" } }\n')
    proc = start_pier([repo], log_path=repo.parent / "pier.log")
    yield proc
    assert proc.stop() == 0, proc.log()
    assert "Cleaning up..." in proc.log()  # finalize() ran at unload


def add_sub_inputs(mod, a: np.ndarray, b: np.ndarray) -> list:
    return numpy_inputs(mod, {"INPUT0": a, "INPUT1": b})


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_add_sub_python_model(server: PierProcess, mod) -> None:
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    a, b = np.array([1, 2, 3, 4], np.float32), np.array([0.5, 0.5, 1, 1], np.float32)
    result = client.infer("add_sub_py", add_sub_inputs(mod, a, b))
    assert np.allclose(result.as_numpy("OUTPUT0"), a + b) and np.allclose(result.as_numpy("OUTPUT1"), a - b)
    meta = client.get_model_metadata("add_sub_py")
    platform = meta["platform"] if mod is httpclient else meta.platform
    assert platform == "python"


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_bls_calls_simple(server: PierProcess, mod) -> None:
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    x0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    x1 = np.full((1, 16), 3, dtype=np.int32)
    result = client.infer("bls_simple", numpy_inputs(mod, {"INPUT0": x0, "INPUT1": x1}))
    assert np.array_equal(result.as_numpy("OUTPUT0"), x0 + x1)
    assert np.array_equal(result.as_numpy("OUTPUT1"), x0 - x1)
    stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("simple")
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 1  # went through `simple`


@pytest.mark.frontends  # request parameters and headers cross the channel
def test_request_arguments_as_triton_hands_them(server: PierProcess) -> None:
    """As Triton: no requested outputs means all of them; tritonclient's own binary_data_output is
    not a model parameter; a BLS model name given as bytes is text; undeclared outputs are dropped."""
    client = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("MODEL", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"simple"], dtype=np.object_))
    result = client.infer("request_args_py", [inp], parameters={"p": 1})
    args = json.loads(result.as_numpy("ARGS")[0])
    assert args == {"requested": ["ARGS", "SUM"], "parameters": {"p": 1}}, args
    assert np.array_equal(result.as_numpy("SUM"), 2 * np.arange(16, dtype=np.int32).reshape(1, 16))
    assert [o["name"] for o in result.get_response()["outputs"]] == ["ARGS", "SUM"]
    out = httpclient.InferRequestedOutput("ARGS")
    args = json.loads(client.infer("request_args_py", [inp], outputs=[out]).as_numpy("ARGS")[0])
    assert args["requested"] == ["ARGS"]


def test_async_bls(server: PierProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    a, b = np.array([1, 2, 3, 4], np.float32), np.array([9, 9, 9, 9], np.float32)
    assert np.allclose(client.infer("async_bls", add_sub_inputs(httpclient, a, b)).as_numpy("OUTPUT0"), 2 * a)


def stream_ints(server: PierProcess, model: str, inp: str, out: str, requests_: dict[str, int]) -> dict[str, list]:
    """Send one INT32 [1] request per id over a gRPC stream (asking for the empty final response);
    return each id's OUT values in order, once every request's final flag arrived. Flag-only
    responses are checked to be Triton's empty final: the model named, no version."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    for rid, n in requests_.items():
        g = grpcclient.InferInput(inp, [1], "INT32")
        g.set_data_from_numpy(np.array([n], dtype=np.int32))
        client.async_stream_infer(model, [g], request_id=rid, enable_empty_final_response=True)
    got: dict[str, list[int]] = {rid: [] for rid in requests_}
    finals: set[str] = set()
    while len(finals) < len(requests_):
        result, error = answers.get(timeout=30)
        assert error is None, error
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            finals.add(response.id)
        if response.outputs:
            got[response.id].append(int(result.as_numpy(out)[0]))
        else:
            assert response.model_name == model and response.model_version == ""
    client.stop_stream()
    return got


def test_decoupled_model_streams_over_grpc(server: PierProcess) -> None:
    got = stream_ints(server, "square_int32", "IN", "OUT", {"three": 3, "five": 5})
    assert got == {"three": [3, 3, 3], "five": [5, 5, 5, 5, 5]}


def test_ensemble_with_a_decoupled_step_streams(server: PierProcess) -> None:
    """As Triton: the ensemble is decoupled (config, and plain infer refused); over a gRPC stream
    each response of the decoupled step comes out through the step after it, then the final flag."""
    http = httpclient.InferenceServerClient(server.http_url)
    assert http.get_model_config("square_double")["model_transaction_policy"] == {"decoupled": True}
    inp = httpclient.InferInput("N", [1], "INT32")
    inp.set_data_from_numpy(np.array([2], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="decoupled"):
        http.infer("square_double", [inp])
    got = stream_ints(server, "square_double", "N", "DOUBLED", {"n3": 3, "n0": 0})
    assert got == {"n3": [6, 6, 6], "n0": []}
    stats = http.get_inference_statistics("double_int32")["model_stats"][0]
    assert stats["inference_count"] == 3  # the step after the decoupled one ran once per response
    # and over HTTP with Triton's generate_stream (server-sent events)
    r = requests.post(f"{server.base()}/v2/models/square_double/generate_stream", json={"N": 2}, timeout=30)
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert r.status_code == 200 and [e["DOUBLED"] for e in events if "DOUBLED" in e] == [4, 4], r.text


def test_a_cancelled_ensemble_stream_stops_its_decoupled_step(server: PierProcess) -> None:
    http = httpclient.InferenceServerClient(server.http_url)

    def doubled() -> int:
        return http.get_inference_statistics("double_int32")["model_stats"][0]["inference_count"]

    before = doubled()
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    g = grpcclient.InferInput("N", [1], "INT32")
    g.set_data_from_numpy(np.array([500], dtype=np.int32))  # 500 responses, 10 ms apart
    client.async_stream_infer("square_double", [g])
    for _ in range(2):
        assert answers.get(timeout=30)[1] is None
    client.stop_stream(cancel_requests=True)
    time.sleep(1.0)
    settled = doubled()
    time.sleep(0.5)
    assert doubled() == settled and settled - before < 200, (before, settled)


def test_decoupled_model_refuses_plain_infer(server: PierProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([2], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="decoupled"):
        client.infer("square_int32", [inp])


def _mode(mod, text: str) -> list:
    inp = mod.InferInput("MODE", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    return [inp]


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_model_errors_fail_only_their_request(server: PierProcess, mod) -> None:
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    before = requests.get(f"{server.base()}/v2/models/fails_py/stats", timeout=10).json()["model_stats"][0]
    with pytest.raises(InferenceServerException, match="asked to raise") as raised:
        client.infer("fails_py", _mode(mod, "raise"))
    assert "fails_py" in str(raised.value)
    with pytest.raises(InferenceServerException, match="bad mode: error") as err:
        client.infer("fails_py", _mode(mod, "error"))
    if mod is httpclient:
        assert err.value.status() == "400"  # TritonError INVALID_ARG -> 400
    assert client.infer("fails_py", _mode(mod, "hello")).as_numpy("ECHO")[0] == b"hello"
    assert client.is_server_live()
    after = requests.get(f"{server.base()}/v2/models/fails_py/stats", timeout=10).json()["model_stats"][0]
    # As Triton 2.51 counts them: every execution, but only successful inferences.
    assert after["inference_count"] - before["inference_count"] == 1
    assert after["execution_count"] - before["execution_count"] == 3
    stats = after["inference_stats"]
    assert stats["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 2


def test_dynamic_batching_hands_execute_a_list(server: PierProcess) -> None:
    results: list[np.ndarray] = []
    lock = threading.Lock()

    def call(i: int) -> None:  # plain HTTP/JSON (tritonclient.http clients do not like threads)
        body = {"inputs": [{"name": "X", "datatype": "INT64", "shape": [1, 1], "data": [i]}]}
        doc = requests.post(f"{server.base()}/v2/models/batch_count_py/infer", json=body, timeout=30).json()
        y = np.array(doc["outputs"][0]["data"]).reshape(doc["outputs"][0]["shape"])
        with lock:
            results.append(y)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(int(y[0, 0]) for y in results) == list(range(6))  # each got its own row
    assert max(int(y[0, 1]) for y in results) > 1  # execute() saw several requests at once


def test_python_model_load_errors(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "no_class" / "1").mkdir(parents=True)
    (repo / "no_class" / "config.pbtxt").write_text(
        'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    (repo / "no_class" / "1" / "model.py").write_text("x = 1\n")
    (repo / "bad_init" / "1").mkdir(parents=True)
    (repo / "bad_init" / "config.pbtxt").write_text((repo / "no_class" / "config.pbtxt").read_text())
    (repo / "bad_init" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('no weights')\n")
    shutil.copytree(PY_MODELS / "add_sub_py", repo / "add_sub_py")
    server = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false", log_path=tmp_path / "l.log")
    try:
        index = {r["name"]: r for r in httpclient.InferenceServerClient(server.http_url).get_model_repository_index()}
        assert "defines no class TritonPythonModel" in index["no_class"]["reason"]
        assert "initialize() of python model 'bad_init' failed: RuntimeError: no weights" in index["bad_init"]["reason"]
        assert index["add_sub_py"]["state"] == "READY"
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("model", ["auto_add_sub", "auto_add_sub_reexport"])
def test_auto_complete_config_declares_the_tensors(server: PierProcess, model: str) -> None:
    """auto_add_sub_reexport's model.py takes its class from another module (as Triton's QA models
    do): its config is auto-completed all the same."""
    client = httpclient.InferenceServerClient(server.http_url)
    config = client.get_model_config(model)
    assert config["max_batch_size"] == 8 and "dynamic_batching" in config
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"] and config["input"][0]["dims"] == [4]
    assert [o["name"] for o in config["output"]] == ["OUTPUT0"]
    a = np.array([[1, 2, 3, 4]], np.float32)
    inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    assert np.allclose(client.infer(model, inputs).as_numpy("OUTPUT0"), a * a)


SIBLING_IMPL = """import numpy as np
import triton_python_backend_utils as pb_utils

WIDTH = {width}


class {cls}:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({{"name": "X", "data_type": "TYPE_FP32", "dims": [WIDTH]}})
        config.add_output({{"name": "Y", "data_type": "TYPE_FP32", "dims": [WIDTH]}})
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * WIDTH)]) for r in requests]
"""


def test_auto_complete_through_sibling_modules_of_the_same_name(tmp_path: Path) -> None:
    """Two models whose model.py star-imports a sibling `impl.py` (each its own), and one whose
    class takes auto_complete_config from a base class in a sibling: each gets its own config."""
    repo = tmp_path / "repo"
    for name, width in (("sibling_a", 2), ("sibling_b", 3)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text('backend: "python"\n')
        (repo / name / "1" / "impl.py").write_text(SIBLING_IMPL.format(width=width, cls="TritonPythonModel"))
        (repo / name / "1" / "model.py").write_text("from impl import *  # noqa: F403\n")
    (repo / "based" / "1").mkdir(parents=True)
    (repo / "based" / "config.pbtxt").write_text('backend: "python"\n')
    (repo / "based" / "1" / "base_impl.py").write_text(SIBLING_IMPL.format(width=4, cls="Base"))
    (repo / "based" / "1" / "model.py").write_text(
        "from base_impl import Base\n\n\nclass TritonPythonModel(Base):\n    pass\n")
    server = start_pier([repo], log_path=tmp_path / "pier.log")
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        for name, width in (("sibling_a", 2), ("sibling_b", 3), ("based", 4)):
            config = client.get_model_config(name)
            assert config["input"][0]["dims"] == [width], (name, config["input"])
            x = httpclient.InferInput("X", [width], "FP32")
            x.set_data_from_numpy(np.ones(width, np.float32))
            assert client.infer(name, [x]).as_numpy("Y").tolist() == [float(width)] * width
    finally:
        assert server.stop() == 0


def test_bls_on_a_decoupled_model(server: PierProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([4], dtype=np.int32))
    assert int(client.infer("bls_decoupled_sum", [inp]).as_numpy("SUM")[0]) == 16  # 4 responses of 4


def test_generate_needs_exactly_one_response(server: PierProcess) -> None:
    """Triton's rule for /generate on a decoupled model: one response answers; none or several are
    a 400 (generate_stream is the endpoint for several), and the server keeps serving."""
    url = f"{server.base()}/v2/models/square_int32"
    r = requests.post(f"{url}/generate", json={"IN": 1}, timeout=30)
    assert r.status_code == 200 and r.json()["OUT"] == 1, r.text
    for n, word in ((3, "more"), (0, "none")):
        r = requests.post(f"{url}/generate", json={"IN": n}, timeout=30)
        assert r.status_code == 400 and "exactly 1 response" in r.json()["error"] and word in r.json()["error"]
    events = requests.post(f"{url}/generate_stream", json={"IN": 3}, timeout=30).text.split("\n\n")
    assert [json.loads(e.removeprefix("data: "))["OUT"] for e in events if e] == [3, 3, 3]


def test_custom_metrics(server: PierProcess) -> None:
    """pb_utils.MetricFamily families on the metrics port: the text Triton 2.51 exported for the
    same model and requests (probed side by side), and Triton's refusals of misuse."""
    for data in ([1.0, 2.0, 3.0], [5.0]):
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, len(data)], "data": data}]}
        r = requests.post(f"{server.base()}/v2/models/metric_py/infer", json=body, timeout=30)
        assert r.status_code == 200, r.text
    outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert outputs["VALUE"] == [2.0]
    assert outputs["OUTPUT0"][0].split("|") == [
        "TritonModelException:Failed to increment metric value: TRITONSERVER_METRIC_KIND_COUNTER can only be "
        "incremented monotonically by non-negative values.",
        "TritonModelException:Failed to set metric value: TRITONSERVER_METRIC_KIND_COUNTER does not support Set",
        "TritonModelException:Failed to increment metric value: TRITONSERVER_METRIC_KIND_HISTOGRAM does not support "
        "Increment",
        "TritonModelException:Failed to observe metric value: TRITONSERVER_METRIC_KIND_GAUGE does not support Observe"]
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    labels = '{model="metric_py",version="1"}'
    expected = (
        "# HELP custom_requests Requests seen\n# TYPE custom_requests counter\n"
        f"custom_requests{labels} 2\n"
        "# HELP custom_depth Last input sum\n# TYPE custom_depth gauge\n"
        f"custom_depth{labels} 5\n"
        "# HELP custom_sizes Input sizes\n# TYPE custom_sizes histogram\n"
        f"custom_sizes_count{labels} 2\ncustom_sizes_sum{labels} 4\n"
        'custom_sizes_bucket{model="metric_py",version="1",le="1"} 1\n'
        'custom_sizes_bucket{model="metric_py",version="1",le="4"} 2\n'
        'custom_sizes_bucket{model="metric_py",version="1",le="16"} 2\n'
        'custom_sizes_bucket{model="metric_py",version="1",le="+Inf"} 2\n')
    assert expected in text, text


LOADER_MODEL = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            action = pb_utils.get_input_tensor_by_name(r, "ACTION").as_numpy()[0].decode()
            target = pb_utils.get_input_tensor_by_name(r, "TARGET").as_numpy()[0].decode()
            try:
                if action == "ready":
                    result = str(pb_utils.is_model_ready(target))
                elif action == "ready_bad_version":
                    result = str(pb_utils.is_model_ready(target, "abc"))
                elif action == "load":
                    pb_utils.load_model(target)
                    result = "loaded"
                elif action == "load_small":
                    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 2})
                    pb_utils.load_model(target, config=config)
                    result = "loaded"
                else:
                    pb_utils.unload_model(target)
                    result = "unloaded"
            except pb_utils.TritonModelException as exc:
                result = "error: " + exc.message()
            text = np.array([result.encode()], dtype=np.object_)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("RESULT", text)]))
        return out
'''
LOADER_CONFIG = """name: "loader_py"
backend: "python"
input [ { name: "ACTION" data_type: TYPE_STRING dims: [ 1 ] }, { name: "TARGET" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "RESULT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def test_models_load_and_unload_models(tmp_path) -> None:
    """pb_utils.load_model / unload_model / is_model_ready from inside a model (explicit mode)."""
    repo = tmp_path / "repo"
    (repo / "loader_py" / "1").mkdir(parents=True)
    (repo / "loader_py" / "1" / "model.py").write_text(LOADER_MODEL)
    (repo / "loader_py" / "config.pbtxt").write_text(LOADER_CONFIG)
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    proc = start_pier([repo], "--model-control-mode=explicit", "--load-model=loader_py", log_path=tmp_path / "log")
    try:
        client = httpclient.InferenceServerClient(proc.http_url)

        def call(action: str, target: str = "simple") -> str:
            inputs = []
            for name, text in (("ACTION", action), ("TARGET", target)):
                t = httpclient.InferInput(name, [1], "BYTES")
                t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
                inputs.append(t)
            return client.infer("loader_py", inputs).as_numpy("RESULT")[0].decode()

        assert call("ready") == "False"
        assert "should be an integral value > 0" in call("ready_bad_version")
        assert call("load") == "loaded" and client.is_model_ready("simple") and call("ready") == "True"
        assert call("load_small") == "loaded"  # a config override, as the repository API takes
        assert client.get_model_config("simple")["max_batch_size"] == 2
        assert call("unload") == "unloaded" and not client.is_model_ready("simple")
        assert call("load", "no_such_model").startswith("error: Failed to load the model 'no_such_model'")
    finally:
        assert proc.stop() == 0


def countdown_stream(server: PierProcess, model: str, starts: dict[str, int]) -> dict[str, list]:
    """One INPUT [1, 1] request per id over a gRPC stream; each id's OUTPUT values (or its error)."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    for rid, n in starts.items():
        g = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        g.set_data_from_numpy(np.array([[n]], dtype=np.int32))
        client.async_stream_infer(model, [g], request_id=rid, enable_empty_final_response=True)
    got: dict[str, list] = {rid: [] for rid in starts}
    done: set[str] = set()
    while len(done) < len(starts):
        result, error = answers.get(timeout=30)
        if error is not None:  # the stream's error names no request: the one model of this call
            got[next(r for r in starts if r not in done)].append(str(error))
            done.add(next(r for r in starts if r not in done))
            continue
        response = result.get_response()
        if response.outputs:
            got[response.id].append(int(result.as_numpy("OUTPUT")[0][0]))
        if response.parameters["triton_final_response"].bool_param:
            done.add(response.id)
    client.stop_stream()
    return got


def test_request_rescheduling_of_an_iterative_decoupled_model(server: PierProcess) -> None:
    """Triton's request rescheduling (python backend, `iterative_sequence: true`): a request the
    model releases with RESCHEDULE runs again, without START and with the same correlation ID, until
    the model answers it finally; concurrent requests are sequences of their own."""
    got = countdown_stream(server, "iterative_countdown", {"a": 3, "b": 2, "c": 1})
    assert got == {"a": [2, 1, 0], "b": [1, 0], "c": [0]}
    # over HTTP's generate_stream too (Triton's iterative-sequence test)
    r = requests.post(f"{server.base()}/v2/models/iterative_countdown/generate_stream", json={"INPUT": 2},
                      timeout=30)
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert r.status_code == 200 and [e["OUTPUT"] for e in events] == [1, 0], r.text


def test_a_rescheduled_request_runs_again_on_its_own_instance(server: PierProcess) -> None:
    """With two instances, each keeping its sequences' countdowns itself: every execution of an
    iterative sequence reaches the instance that began it (as Triton routes a sequence), 8 at once."""
    starts = {f"r{i}": 2 + i % 3 for i in range(8)}
    got = countdown_stream(server, "iterative_countdown_2", starts)
    assert got == {rid: list(range(n - 1, -1, -1)) for rid, n in starts.items()}, got


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_request_rescheduling_of_an_iterative_model(server: PierProcess, mod) -> None:
    """Not decoupled: a rescheduled request's entry in execute()'s responses is None; the client
    gets the one answer of the execution that did not reschedule."""
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    for steps in (1, 4):
        result = client.infer("iterative_steps", numpy_inputs(mod, {"STEPS": np.array([steps], np.int32)}))
        assert result.as_numpy("EXECUTIONS").tolist() == [steps]
    # sequence flags a client sends anyway do not reach the model: the batcher owns them here
    result = client.infer("iterative_steps", numpy_inputs(mod, {"STEPS": np.array([2], np.int32)}),
                          sequence_id=9, sequence_start=True, sequence_end=True)
    assert result.as_numpy("EXECUTIONS").tolist() == [2]


def test_rescheduling_without_iterative_sequences_fails_the_request(server: PierProcess) -> None:
    """As Triton: RESCHEDULE on a model whose scheduler cannot reschedule fails that request with
    an error that says so; the model keeps serving."""
    got = countdown_stream(server, "reschedule_dynamic", {"x": 2})
    assert len(got["x"]) == 2 and got["x"][0] == 1, got  # the response sent before the release, then the error
    assert "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE" in got["x"][1]
    assert "iterative_sequence" in got["x"][1]
    assert countdown_stream(server, "reschedule_dynamic", {"y": 1}) == {"y": [0]}


@pytest.mark.parametrize("mode", ["process", "in_process"])
def test_an_unload_lets_the_streams_in_flight_finish(tmp_path: Path, mode: str) -> None:
    """As Triton: unloading a decoupled python model waits for the requests it is still answering
    (each stream gets every response and its final flag), then the model unloads. Before, the stub
    was finalized at once and the stream ended with "model 'square_int32' was unloaded"."""
    repo = tmp_path / "repo"
    shutil.copytree(PY_MODELS / "square_int32", repo / "square_int32")
    if mode == "in_process":
        with (repo / "square_int32" / "config.pbtxt").open("a") as f:
            f.write('parameters { key: "execution_mode" value: { string_value: "in_process" } }\n')
    server = start_pier([repo], "--model-control-mode=explicit", "--load-model=square_int32",
                        log_path=tmp_path / "pier.log")
    try:
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
        n = 150  # 10 ms apart
        inp = grpcclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([n], dtype=np.int32))
        client.async_stream_infer("square_int32", [inp], request_id="long", enable_empty_final_response=True)
        assert answers.get(timeout=30)[1] is None
        unload = threading.Thread(target=httpclient.InferenceServerClient(server.http_url).unload_model,
                                  args=("square_int32",))
        unload.start()
        got, final = 1, False
        while not final:
            result, error = answers.get(timeout=30)
            assert error is None, f"the stream was cut after {got} of {n} responses: {error}"
            final = result.get_response().parameters["triton_final_response"].bool_param
            got += 0 if final else 1
        assert got == n
        unload.join(30)
        deadline = time.monotonic() + 30
        while requests.get(f"{server.base()}/v2/models/square_int32/ready", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the model did not unload once its stream ended"
            time.sleep(0.1)
        client.stop_stream()
    finally:
        server.stop()
    assert "unloads once its 1 decoupled request(s) still sending end" in server.log() or mode == "in_process"


ROUNDS = 50
FAILURES = {0: "failed after sending", 1: "failed after sending",
            2: "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE"}


@pytest.mark.frontends  # streams are relayed
@pytest.mark.parametrize("model", ["send_then_fail", "send_then_fail_inproc"])
@pytest.mark.parametrize("mode", sorted(FAILURES), ids=["raises", "error_response", "reschedule_refused"])
def test_a_response_sent_before_a_failure_arrives_first_over_grpc_streams(server: PierProcess, model: str,
                                                                         mode: int) -> None:
    """A decoupled model that sends a response and then fails the request (raises, sends an error
    response, releases it with a RESCHEDULE it cannot have): the response arrives, then the error,
    round after round (the stub's sends and its execute's result cross on two channels: the result
    must not overtake them)."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    try:
        for i in range(ROUNDS):
            g = grpcclient.InferInput("MODE", [1], "INT32")
            g.set_data_from_numpy(np.array([mode], dtype=np.int32))
            client.async_stream_infer(model, [g], request_id=str(i))
            result, error = answers.get(timeout=30)
            assert error is None, f"round {i}: the error came first, the response sent before it was lost: {error}"
            assert result.get_response().id == str(i) and result.as_numpy("OUT").tolist() == [7]
            result, error = answers.get(timeout=30)
            assert result is None and FAILURES[mode] in str(error), (i, result, error)
    finally:
        client.stop_stream()


@pytest.mark.frontends  # generate_stream is relayed
@pytest.mark.parametrize("model", ["send_then_fail", "send_then_fail_inproc"])
@pytest.mark.parametrize("mode", sorted(FAILURES), ids=["raises", "error_response", "reschedule_refused"])
def test_a_response_sent_before_a_failure_arrives_first_over_generate_stream(server: PierProcess, model: str,
                                                                            mode: int) -> None:
    """The same race over HTTP generate_stream: 200, the response's event, then the error's."""
    with requests.Session() as http:
        for i in range(ROUNDS):
            r = http.post(f"{server.base()}/v2/models/{model}/generate_stream", json={"MODE": mode}, timeout=30)
            events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
            assert r.status_code == 200 and len(events) == 2 and events[0].get("OUT") == 7, (i, r.status_code, events)
            assert FAILURES[mode] in events[1]["error"], (i, events)


@pytest.mark.frontends  # response parameters cross back
@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_response_parameters_reach_the_client(server: PierProcess, mod) -> None:
    """A python model's InferenceResponse(parameters=...) comes back in the response's parameters."""
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    result = client.infer("response_params_py", numpy_inputs(mod, {"IN": np.array([7], np.int32)}))
    assert result.as_numpy("OUT").tolist() == [7]
    if mod is httpclient:
        assert result.get_response()["parameters"] == {"count": 7, "label": "seen", "ok": True}
    else:
        params = result.get_response().parameters
        assert (params["count"].int64_param, params["label"].string_param, params["ok"].bool_param) == (7, "seen", True)


def test_generate_shapes_values_to_the_model_and_reports_model_errors(server: PierProcess) -> None:
    """Triton's generate extension on a model with [1, 1] inputs (Triton's qa mock_llm): values are
    shaped to the model's dims; an input given twice is refused; a model whose first response is an
    error answers generate_stream with 400 and that error as the one event."""
    url = f"{server.base()}/v2/models/mock_llm"
    r = requests.post(f"{url}/generate", json={"PROMPT": "hello world", "STREAM": False}, timeout=30)
    assert r.status_code == 200 and r.json()["TEXT"] == "hello world", r.text
    r = requests.post(f"{url}/generate_stream", json={"PROMPT": "hi", "STREAM": True, "REPETITION": 3}, timeout=30)
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert r.status_code == 200 and [e["TEXT"] for e in events] == ["hi"] * 3, r.text
    r = requests.post(f"{url}/generate", data=b'{"PROMPT": "hello", "STREAM": false, "PROMPT": "duplicate"}',
                      timeout=30)
    assert r.status_code == 400 and "input 'PROMPT' already exists in request" in r.json()["error"], r.text
    r = requests.post(f"{url}/generate_stream", timeout=30,
                      json={"PROMPT": "x", "STREAM": True, "REPETITION": 0, "FAIL_LAST": True})
    assert r.status_code == 400 and r.headers["Content-Type"].startswith("text/event-stream"), r.text
    assert [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")] == \
        [{"error": "An Error Occurred"}]
    r = requests.post(f"{url}/generate_stream", timeout=30,  # refused before it runs: a plain JSON error
                      json={"PROMPT": "x"})
    assert r.status_code == 400 and r.headers["Content-Type"].startswith("application/json"), r.text
    # Triton's words (qa L0_http generate_endpoint_test compares them), on both endpoints
    for body, text in (({"PROMPT": "hello", "STREAM": "false"}, "attempt to access JSON non-boolean as boolean"),
                       ({"PROMPT": 123, "STREAM": False}, "attempt to access JSON non-string as string"),
                       ({"STREAM": 123, "PROMPT": True}, "attempt to access JSON non-boolean as boolean"),
                       ({"PROMPT": "x", "STREAM": True, "parameters": 1},
                        "Expected JSON object for keyword: 'parameters'"),
                       ({"PROMPT": "x", "STREAM": True, "parameters": {"nested": {"twice": 1}}},
                        "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
                       ({"PROMPT": "x", "STREAM": True, "PARAMS": {"P": 0}}, "parameter 'PARAMS' has invalid type"),
                       ({"abc": 123}, "expected number of inputs between 2 and 4 but got 0")):
        for endpoint in ("generate", "generate_stream"):
            r = requests.post(f"{url}/{endpoint}", json=body, timeout=30)
            assert r.status_code == 400 and text in r.json()["error"], (endpoint, body, r.text)


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_ensemble_steps_get_the_request_parameters(server: PierProcess, mod) -> None:
    """As Triton (qa L0_parameters): the parameters a client sends an ensemble reach its steps."""
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    inp = mod.InferInput("MODEL", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"simple"], dtype=np.object_))
    result = client.infer("args_ensemble", [inp], parameters={"key1": "value1", "key2": 2})
    assert json.loads(result.as_numpy("ARGS")[0])["parameters"] == {"key1": "value1", "key2": 2}


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_a_model_that_is_not_decoupled_may_answer_through_its_sender(server: PierProcess, mod) -> None:
    """As Triton 2.51 (qa/L0_metrics async_execute): a model that is not decoupled may return
    None and send its one response per request through the request's sender, even after
    execute() returned (Pier refused get_response_sender() there)."""
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    inp = mod.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([7], dtype=np.int32))
    assert client.infer("sender_py", [inp]).as_numpy("OUT").tolist() == [21]
    inp.set_data_from_numpy(np.array([0], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="closed a response sender without a response"):
        client.infer("sender_py", [inp])
