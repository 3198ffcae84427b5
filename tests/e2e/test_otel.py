"""`--trace-config mode=opentelemetry` on a real `pier serve`, its spans received by a real OTLP
receiver (tests/otlp_receiver.py: opentelemetry-proto's ExportTraceServiceRequest over OTLP/HTTP
and OTLP/gRPC). The assertions are Triton's QA's (qa/L0_trace/opentelemetry_unittest.py): span
names, the parent map, each span's events (exactly), the caller's traceparent as the root's
parent, the resource attributes given with `opentelemetry,resource=`; then the trace settings
(rate, count, level, per model) in this mode, and a collector that is down."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import EXAMPLE_REPO, start_pier
from tests.otlp_receiver import OtlpReceiver, tree

pytestmark = pytest.mark.frontends  # the frontends hand the traceparent on (over the wire with frontend processes)

TRACE_ID = "0af7651916cd43dd8448eb211c12666c"
PARENT = "b7ad6b7169242424"
HEADERS = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
ROOT_HTTP = ["HTTP_RECV_START", "HTTP_RECV_END", "INFER_RESPONSE_COMPLETE", "HTTP_SEND_START", "HTTP_SEND_END"]
ROOT_GRPC = ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "INFER_RESPONSE_COMPLETE", "GRPC_SEND_START",
             "GRPC_SEND_END"]
MODEL_EVENTS = ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
COMPUTE_EVENTS = ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
ENSEMBLE = "ensemble_add_sub_int32_int32_int32"

ENSEMBLE_CONFIG = f"""name: "{ENSEMBLE}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }},
        {{ name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }},
         {{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "simple" model_version: -1
  input_map {{ key: "INPUT0" value: "INPUT0" }} input_map {{ key: "INPUT1" value: "INPUT1" }}
  output_map {{ key: "OUTPUT0" value: "OUTPUT0" }} output_map {{ key: "OUTPUT1" value: "OUTPUT1" }} }} ] }}
"""
# Triton's QA model qa/python_models/bls_simple: a BLS call to the model named in MODEL_NAME,
# handing on its own trace (trace=request.trace()).
BLS_CONFIG = """name: "bls_simple"
backend: "python"
max_batch_size: 0
input [ { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1, 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 1, 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
BLS_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            model_name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            infer_request = pb_utils.InferenceRequest(
                model_name=model_name, requested_output_names=["OUTPUT0", "OUTPUT1"], inputs=[in_0, in_1],
                trace=request.trace())
            infer_response = infer_request.exec()
            responses.append(pb_utils.InferenceResponse(output_tensors=infer_response.output_tensors()))
        return responses
"""
# Triton's QA model qa/L0_trace/trace_context.py: the model reads its request's trace context.
CONTEXT_CONFIG = """name: "trace_context"
backend: "python"
max_batch_size: 0
input [ { name: "expect_none" data_type: TYPE_BOOL dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
CONTEXT_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            expect_none = pb_utils.get_input_tensor_by_name(request, "expect_none").as_numpy()[0]
            context = request.trace().get_context()
            if expect_none and context is not None:
                raise pb_utils.TritonModelException("Context should be None")
            if not expect_none and context is None:
                raise pb_utils.TritonModelException("Context should NOT be None")
            output = pb_utils.Tensor("OUTPUT0", np.array(context).astype(np.bytes_))
            responses.append(pb_utils.InferenceResponse([output]))
        return responses
"""


def _repo(root: Path) -> Path:
    repo = root / "repo"
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    for name, config, model in ((ENSEMBLE, ENSEMBLE_CONFIG, None), ("bls_simple", BLS_CONFIG, BLS_MODEL),
                                ("trace_context", CONTEXT_CONFIG, CONTEXT_MODEL)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        if model is not None:
            (repo / name / "1" / "model.py").write_text(textwrap.dedent(model))
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver):
    root = tmp_path_factory.mktemp("otel")
    proc = start_pier([_repo(root)], "--trace-config=mode=opentelemetry",
                      f"--trace-config=opentelemetry,url={receiver.url}",
                      "--trace-config=rate=1", "--trace-config=level=TIMESTAMPS", "--trace-config=count=-1",
                      "--trace-config=opentelemetry,bsp_schedule_delay=50",
                      "--trace-config=opentelemetry,resource=test.key=test.value",
                      "--trace-config=opentelemetry,resource=service.name=test_pier", log_path=root / "pier.log")
    yield proc
    assert proc.stop() == 0


def _inputs(module, with_name: str | None = None) -> list:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(data)
    inputs[1].set_data_from_numpy(data)
    if with_name is not None:
        name = module.InferInput("MODEL_NAME", [1], "BYTES")
        name.set_data_from_numpy(np.array([with_name.encode()], dtype=object))
        inputs.insert(0, name)
    return inputs


def _check_events(spans: list[dict], root_events: list[str]) -> None:
    for s in spans:
        events = [e["name"] for e in s["events"]]
        expected = root_events if s["name"] == "InferRequest" else COMPUTE_EVENTS if s["name"] == "compute" \
            else MODEL_EVENTS
        assert events == expected, (s["name"], events)
        assert s["kind"] == 2 and s["scope"] == "triton-server"  # SERVER spans of Triton's tracer
        assert s["start"] <= s["end"] and abs(s["start"] / 1e9 - time.time()) < 120  # wall clock


def _one_trace(receiver: OtlpReceiver, count: int, trace_id: str | None = None) -> list[dict]:
    if trace_id is not None:
        return receiver.trace(trace_id, count)
    spans = receiver.wait(count)
    time.sleep(0.3)  # nothing more arrives
    assert len(receiver.spans) == count, [s["name"] for s in receiver.spans]
    assert len({s["traceId"] for s in spans}) == 1
    return spans


def _root(spans: list[dict]) -> dict:
    return next(s for s in spans if s["name"] == "InferRequest")


def test_http_request_with_traceparent(server, receiver) -> None:
    receiver.clear()
    with httpclient.InferenceServerClient(server.http_url) as client:
        client.infer("simple", _inputs(httpclient), request_id="r-42", headers=dict(HEADERS))
    spans = _one_trace(receiver, 3, TRACE_ID)
    assert tree(spans) == {"InferRequest": ["simple"], "simple": ["compute"]}
    _check_events(spans, ROOT_HTTP)
    root = _root(spans)
    assert root["traceId"] == TRACE_ID and root["parentSpanId"] == PARENT  # the caller's span is the parent
    model = next(s for s in spans if s["name"] == "simple")
    assert model["attributes"] == {"triton.model_name": "simple", "triton.model_version": 1,
                                   "triton.trace_id": model["attributes"]["triton.trace_id"],
                                   "triton.trace_parent_id": 0, "triton.request_id": "r-42"}
    assert isinstance(model["attributes"]["triton.model_version"], int)
    assert root["resource"]["test.key"] == "test.value" and root["resource"]["service.name"] == "test_pier"


def test_grpc_request_with_traceparent_and_without(server, receiver) -> None:
    receiver.clear()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.infer("simple", _inputs(grpcclient), headers=dict(HEADERS))
    spans = _one_trace(receiver, 3, TRACE_ID)
    assert tree(spans) == {"InferRequest": ["simple"], "simple": ["compute"]}
    _check_events(spans, ROOT_GRPC)
    assert _root(spans)["parentSpanId"] == PARENT
    assert "triton.request_id" not in next(s for s in spans if s["name"] == "simple")["attributes"]
    receiver.clear()
    client.infer("simple", _inputs(grpcclient))  # no traceparent: a trace of its own, with no parent
    spans = _one_trace(receiver, 3)
    assert _root(spans)["parentSpanId"] == "" and _root(spans)["traceId"] != TRACE_ID


def test_ensemble_steps_are_child_spans(server, receiver) -> None:
    receiver.clear()
    with httpclient.InferenceServerClient(server.http_url) as client:
        client.infer(ENSEMBLE, _inputs(httpclient), headers=dict(HEADERS))
    spans = _one_trace(receiver, 4, TRACE_ID)
    assert tree(spans) == {"InferRequest": [ENSEMBLE], ENSEMBLE: ["simple"], "simple": ["compute"]}
    _check_events(spans, ROOT_HTTP)
    parents = {s["name"]: s["attributes"].get("triton.trace_parent_id") for s in spans}
    ids = {s["name"]: s["attributes"].get("triton.trace_id") for s in spans}
    assert parents["simple"] == ids[ENSEMBLE] and parents[ENSEMBLE] == 0


def test_bls_calls_are_child_spans(server, receiver) -> None:
    """Triton's QA: bls_simple -> the ensemble -> simple: six spans."""
    receiver.clear()
    with httpclient.InferenceServerClient(server.http_url) as client:
        client.infer("bls_simple", _inputs(httpclient, ENSEMBLE), headers=dict(HEADERS))
    spans = _one_trace(receiver, 6, TRACE_ID)
    assert tree(spans) == {"InferRequest": ["bls_simple"], "bls_simple": sorted(["compute", ENSEMBLE]),
                           ENSEMBLE: ["simple"], "simple": ["compute"]}
    _check_events(spans, ROOT_HTTP)
    assert _root(spans)["parentSpanId"] == PARENT


def test_trace_context_exposed_to_python_models(server, receiver) -> None:
    receiver.clear()
    with httpclient.InferenceServerClient(server.http_url) as client:
        flag = httpclient.InferInput("expect_none", [1], "BOOL")
        flag.set_data_from_numpy(np.array([False]))
        result = client.infer("trace_context", [flag], headers=dict(HEADERS))
    context = json.loads(result.as_numpy("OUTPUT0")[()].decode())
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", context["traceparent"])
    assert context["traceparent"].split("-")[1] == TRACE_ID  # the model's own span, in the caller's trace
    model = next(s for s in receiver.trace(TRACE_ID, 3) if s["name"] == "trace_context")
    assert context["traceparent"].split("-")[2] == model["spanId"]


def test_settings_rate_count_and_level_in_this_mode(server, receiver) -> None:
    base = server.base()
    settings = requests.get(base + "/v2/trace/setting", timeout=10).json()
    assert settings["trace_mode"] == "opentelemetry"
    assert "trace_file" not in settings and "log_frequency" not in settings
    assert settings["url"] == receiver.url and settings["bsp_max_queue_size"] == "2048"
    try:
        # rate 3: every third request is traced; one with a traceparent always is (as Triton)
        rated = requests.post(base + "/v2/trace/setting", json={"trace_rate": "3"}, timeout=10)
        assert rated.json()["trace_rate"] == "3"
        receiver.clear()
        with httpclient.InferenceServerClient(server.http_url) as client:
            for _ in range(6):
                client.infer("simple", _inputs(httpclient))
            client.infer("simple", _inputs(httpclient), headers=dict(HEADERS))
        spans = receiver.wait(9)
        time.sleep(0.3)
        assert len(receiver.spans) == 9 and sum(s["name"] == "InferRequest" for s in spans) == 3
        # count 1: one more trace, then only requests that carry a traceparent
        requests.post(base + "/v2/trace/setting", json={"trace_rate": "1", "trace_count": "1"}, timeout=10)
        receiver.clear()
        with httpclient.InferenceServerClient(server.http_url) as client:
            for _ in range(3):
                client.infer("simple", _inputs(httpclient))
            client.infer("simple", _inputs(httpclient), headers=dict(HEADERS))
        receiver.wait(6)
        time.sleep(0.3)
        assert len(receiver.spans) == 6
        assert requests.get(base + "/v2/trace/setting", timeout=10).json()["trace_count"] == "0"
        # a model's level OFF: not even a request with a traceparent is traced for it
        requests.post(base + "/v2/trace/setting", json={"trace_count": "-1"}, timeout=10)
        off = requests.post(base + "/v2/models/simple/trace/setting", json={"trace_level": ["OFF"]}, timeout=10)
        assert off.json()["trace_level"] == ["OFF"]
        receiver.clear()
        with httpclient.InferenceServerClient(server.http_url) as client:
            client.infer("simple", _inputs(httpclient), headers=dict(HEADERS))
            client.infer(ENSEMBLE, _inputs(httpclient))  # traced: the ensemble's level is the global one ...
        spans = receiver.wait(2)
        time.sleep(0.3)
        # ... and its step is its child whatever simple's own settings say (as Triton's child traces)
        assert sorted(s["name"] for s in receiver.spans) == sorted(["InferRequest", ENSEMBLE, "simple", "compute"])
    finally:
        requests.post(base + "/v2/models/simple/trace/setting", json={"trace_level": None}, timeout=10)
        requests.post(base + "/v2/trace/setting", json={"trace_rate": "1", "trace_count": "-1"}, timeout=10)


def test_rate_zero_traces_only_requests_with_a_traceparent_over_grpc_export(tmp_path: Path) -> None:
    """`rate=0` on the command line (Triton's "traceparent only"), and the OTLP/gRPC exporter."""
    receiver = OtlpReceiver()
    proc = start_pier([_repo(tmp_path)], "--trace-config=mode=opentelemetry", "--trace-config=rate=0",
                      "--trace-config=level=TIMESTAMPS", f"--trace-config=opentelemetry,url={receiver.grpc_url}",
                      "--trace-config=opentelemetry,protocol=grpc",
                      "--trace-config=opentelemetry,bsp_schedule_delay=50",
                      log_path=tmp_path / "pier.log")
    try:
        with httpclient.InferenceServerClient(proc.http_url) as client:
            for _ in range(3):
                client.infer("simple", _inputs(httpclient))
            client.infer("simple", _inputs(httpclient), headers=dict(HEADERS))
        spans = receiver.trace(TRACE_ID, 3)
        time.sleep(0.3)
        assert len(receiver.spans) == 3 and tree(spans) == {"InferRequest": ["simple"], "simple": ["compute"]}
        assert spans[0]["resource"]["service.name"] == "pier"
    finally:
        assert proc.stop() == 0
        receiver.close()


def test_collector_down_is_a_warning_and_drops_are_counted(tmp_path: Path) -> None:
    """Nothing listens at the URL: every request is answered, the lost spans are counted, and the
    log says so once (not once per batch)."""
    receiver = OtlpReceiver()
    url = receiver.url
    receiver.close()  # a port that refuses connections
    proc = start_pier([_repo(tmp_path)], "--trace-config=mode=opentelemetry", "--trace-config=rate=1",
                      "--trace-config=level=TIMESTAMPS", f"--trace-config=opentelemetry,url={url}",
                      "--trace-config=opentelemetry,bsp_schedule_delay=20",
                      "--trace-config=opentelemetry,bsp_max_queue_size=8",
                      "--trace-config=opentelemetry,bsp_max_export_batch_size=4",
                      log_path=tmp_path / "pier.log", env={"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"})
    try:
        with httpclient.InferenceServerClient(proc.http_url) as client:
            for _ in range(40):
                result = client.infer("simple", _inputs(httpclient))
                assert (result.as_numpy("OUTPUT0") == 2 * np.arange(16)).all()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            metrics = requests.get(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).text
            counts = dict(re.findall(r'pier_trace_spans_dropped_total\{reason="(\w+)"\} (\d+)', metrics))
            if int(counts["queue_full"]) > 0 and int(counts["export_failed"]) > 0:
                break
            time.sleep(0.2)
        assert int(counts["queue_full"]) > 0 and int(counts["export_failed"]) > 0, counts
        assert "pier_trace_spans_exported_total 0" in metrics
    finally:
        assert proc.stop() == 0
    log = (tmp_path / "pier.log").read_text()
    assert log.count("OpenTelemetry: cannot export spans to") == 1, log[-3000:]
    assert "Transient error" not in log and "Queue full" not in log  # the SDK's own lines stay out
