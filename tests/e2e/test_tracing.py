"""Request tracing (`--trace-config`, the trace extension) on a real `pier serve`: settings over
HTTP and gRPC (global and per model), sampled requests written to the trace file in Triton's
JSON layout (checked against Triton 2.51's own files), and bad settings refused."""

from __future__ import annotations

import json
import queue
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, start_pier

pytestmark = pytest.mark.frontends  # the frontend stamps the receive time of a traced request

HTTP_ORDER = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
              "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE",
              "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tracing")
    for model in ("identity_fp32", "simple"):
        shutil.copytree(EXAMPLE_REPO / model, root / "repo" / model)
    trace_file = root / "trace.json"
    proc = start_pier([root / "repo"], f"--trace-config=triton,file={trace_file}", log_path=root / "pier.log")
    proc.trace_file = trace_file  # type: ignore[attr-defined]
    yield proc
    assert proc.stop() == 0


def _settings(server, model: str = "") -> dict:
    path = f"/v2/models/{model}/trace/setting" if model else "/v2/trace/setting"
    return requests.get(server.base() + path, timeout=10).json()


def _update(server, body, model: str = "") -> requests.Response:
    path = f"/v2/models/{model}/trace/setting" if model else "/v2/trace/setting"
    return requests.post(server.base() + path, json=body, timeout=10)


def _infer_identity(server, rid: str) -> None:
    body = {"id": rid, "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    r = requests.post(f"{server.base()}/v2/models/identity_fp32/infer", json=body, timeout=10)
    assert r.status_code == 200, r.text


def _traces(path: Path) -> dict[int, list[dict]]:
    by_id: dict[int, list[dict]] = {}
    for record in json.loads(path.read_text()):
        by_id.setdefault(record["id"], []).append(record)
    return by_id


def _wait_for(path: Path) -> Path:
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path


def test_tracing_is_off_by_default(server):
    assert _settings(server) == {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                                 "log_frequency": "0", "trace_file": str(server.trace_file), "trace_mode": "triton"}
    _infer_identity(server, "untraced")
    assert not list(server.trace_file.parent.glob("trace.json*"))


def test_sampled_http_requests_are_written_every_log_frequency_traces(server):
    r = _update(server, {"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_count": "3", "log_frequency": "2"})
    assert r.status_code == 200 and r.json()["trace_count"] == "3", r.text
    for i in range(8):  # rate 2: as Triton, the 2nd, 4th and 6th are traced, then the count is used up
        _infer_identity(server, f"r{i}")
    first, second = _wait_for(Path(f"{server.trace_file}.0")), _wait_for(Path(f"{server.trace_file}.1"))
    traces = {**_traces(first), **_traces(second)}
    assert len(_traces(first)) == 2 and len(_traces(second)) == 1  # the last one when the count ran out
    assert _settings(server)["trace_count"] == "0"
    for records in traces.values():
        head = next(r for r in records if "model_name" in r)
        assert head["model_name"] == "identity_fp32" and head["model_version"] == 1
        stamps = [r["timestamps"][0] for r in records if "timestamps" in r]
        assert [s["name"] for s in stamps] == HTTP_ORDER
        ns = {s["name"]: s["ns"] for s in stamps}
        assert [ns[n] for n in HTTP_ORDER if n != "INFER_RESPONSE_COMPLETE"] == sorted(
            ns[n] for n in HTTP_ORDER if n != "INFER_RESPONSE_COMPLETE")
    assert sorted(next(r for r in rs if "model_name" in r)["request_id"] for rs in traces.values()) == \
        ["r1", "r3", "r5"]


def test_a_model_override_traces_grpc_requests_with_tensors(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got = client.update_trace_settings(model_name="simple", settings={
        "trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "1", "trace_count": "1"}, as_json=True)["settings"]
    assert got["trace_level"]["value"] == ["TIMESTAMPS", "TENSORS"] and got["trace_count"]["value"] == ["1"]
    assert _settings(server)["trace_level"] == ["TIMESTAMPS"]  # the global setting is unchanged
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    client.infer("simple", inputs, request_id="g1")
    _infer_identity(server, "not-traced")  # identity_fp32 follows the global settings: count used up
    (records,) = _traces(_wait_for(Path(f"{server.trace_file}.2"))).values()
    names = [r["timestamps"][0]["name"] for r in records if "timestamps" in r]
    assert names == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *HTTP_ORDER[2:-2], "GRPC_SEND_START",
                     "GRPC_SEND_END"]  # `simple` runs unbatched (direct scheduler), identity_fp32 batched
    tensors = {r["tensor"]["name"]: r for r in records if "activity" in r}
    assert tensors["INPUT0"]["activity"] == "TENSOR_QUEUE_INPUT"
    assert tensors["INPUT0"]["tensor"] == {"name": "INPUT0", "data": ",".join(map(str, range(16))),
                                           "shape": "1,16", "dtype": "INT32"}
    assert tensors["OUTPUT0"]["activity"] == "TENSOR_BACKEND_OUTPUT"
    assert tensors["OUTPUT0"]["tensor"]["data"] == ",".join(str(v + 1) for v in range(16))
    # Clearing the override falls back to the global settings.
    cleared = client.update_trace_settings(model_name="simple", settings={"trace_level": None, "trace_count": None,
                                                                          "trace_rate": None}, as_json=True)
    assert cleared["settings"]["trace_level"]["value"] == ["TIMESTAMPS"]
    assert _settings(server, "simple") == _settings(server)


def test_a_model_override_inherits_the_global_settings_it_does_not_set(server):
    """As Triton 2.51 (probed): a model that overrides trace_rate follows later global changes of
    the other keys, trace_count included, until it sets them itself."""
    before = _settings(server)
    try:
        assert _update(server, {"trace_rate": "3"}, model="identity_fp32").status_code == 200
        assert _update(server, {"trace_count": "7", "log_frequency": "2"}).status_code == 200
        got = _settings(server, "identity_fp32")
        assert (got["trace_rate"], got["trace_count"], got["log_frequency"]) == ("3", "7", "2"), got
        _update(server, {"trace_count": "2"}, model="identity_fp32")
        _update(server, {"trace_count": "9"})
        assert _settings(server, "identity_fp32")["trace_count"] == "2"  # its own, now
        _update(server, {"trace_count": None}, model="identity_fp32")
        assert _settings(server, "identity_fp32")["trace_count"] == "9"
        _update(server, {"trace_count": "4"})
        assert _settings(server, "identity_fp32")["trace_count"] == "4"
    finally:
        _update(server, {"trace_rate": None, "trace_count": None}, model="identity_fp32")
        _update(server, {k: before[k] for k in ("trace_count", "log_frequency", "trace_rate")})
    assert _settings(server) == before


def test_requests_on_a_grpc_stream_are_traced_like_single_calls(server):
    r = _update(server, {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1"}, model="simple")
    assert r.status_code == 200, r.text
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    for t in inputs:
        t.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    client.async_stream_infer("simple", inputs, request_id="s1")
    result, error = answers.get(timeout=30)
    client.stop_stream()
    assert error is None, error
    (records,) = _traces(_wait_for(Path(f"{server.trace_file}.3"))).values()
    names = [r["timestamps"][0]["name"] for r in records if "timestamps" in r]
    assert names == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *HTTP_ORDER[2:-2], "GRPC_SEND_START",
                     "GRPC_SEND_END"], names
    assert next(r for r in records if "model_name" in r)["request_id"] == "s1"
    _update(server, {"trace_level": None, "trace_rate": None, "trace_count": None}, model="simple")


def test_bad_settings_are_refused(server):
    before = _settings(server)
    for body, status, text in (
        ({"trace_rate": "0"}, 400, "Unable to parse 'trace_rate'. Expecting value >= 1, got:0"),
        ({"trace_count": "-2"}, 400, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
        ({"trace_rate": 5}, 400, "'trace_rate' must be a string"),
        ({"trace_level": "TIMESTAMPS"}, 400, "'trace_level' must be an array"),
        ({"trace_level": ["LOUD"]}, 400, "invalid value for 'trace_level'"),
        ({"trace_level": ["TIMESTAMPS", "OFF"]}, 400, "cannot combine OFF"),
        ({"trace_rate": "99999999999"}, 400, "out of range"),
        ({"trace_file": "/tmp/elsewhere.json"}, 501, "trace file location can not be updated through network protocol"),
        ({"trace_rate": "1", "log_frequency": "x"}, 400, "log_frequency"),  # nothing applies
    ):
        r = _update(server, body)
        assert r.status_code == status and text in r.json()["error"], (body, r.text)
    assert _settings(server) == before
    assert _update(server, {"unknown": "1"}).json() == before  # ignored, as Triton does
    r = requests.get(f"{server.base()}/v2/models/nope/trace/setting", timeout=10)
    assert r.status_code == 400 and "nope" in r.json()["error"]  # Triton 2.51: 400, not 404
    with pytest.raises(InferenceServerException) as err:
        grpcclient.InferenceServerClient(server.grpc_url).update_trace_settings(settings={"trace_rate": "0"})
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
