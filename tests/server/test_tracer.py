"""Request tracing (server/observability/tracing.py) without a server: which requests a rate and a
count sample, a model's override with its own rate and count (and what it inherits), settings
checked before any applies, traces written every log_frequency to numbered files and the rest at
shutdown, `--trace-config`; and one request served through a DataPlane over a toy model: every
stage's timestamp, from the frontend's receive to its send, in order, with its tensors. (The
file layout against Triton's own files: tests/e2e/test_tracing.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest, InferenceResponse
from pier.dataplane.plane import DataPlane
from pier.lifecycle.routing import RoutingTable
from pier.observability.tracing import Tracer, parse_trace_config
from tests.server.toy import Toy, load, outputs, serve, tensor


def _tracer(tmp_path: Path, **settings: object) -> Tracer:
    return Tracer({"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_file": str(tmp_path / "trace.json"),
                   **settings})


def _sampled(tracer: Tracer, model: str, n: int) -> list[int]:
    """Which of `n` requests to `model` (counted from 1) get a trace."""
    return [i for i in range(1, n + 1) if tracer.sample(model) is not None]


def test_the_rate_th_request_is_traced_until_the_count_is_spent(tmp_path: Path) -> None:
    tracer = _tracer(tmp_path, trace_rate="3", trace_count="2")
    assert tracer.on
    assert _sampled(tracer, "m", 10) == [3, 6]
    assert not tracer.on and tracer.settings()["trace_count"] == "0"  # spent: a request costs one check again
    tracer.update({"trace_rate": "4", "trace_count": "-1"})  # as Triton: an update starts counting afresh
    assert tracer.on and _sampled(tracer, "m", 9) == [4, 8]
    assert not _tracer(tmp_path, trace_level=["OFF"]).on and not Tracer().on


def test_a_models_override_keeps_its_own_rate_and_count_and_inherits_the_rest(tmp_path: Path) -> None:
    tracer = _tracer(tmp_path, trace_rate="2")
    tracer.update({"trace_rate": "3", "trace_count": "1"}, model="own")
    tracer.update({"trace_level": ["TENSORS"]}, model="leveled")
    assert tracer.settings("own")["trace_level"] == ["TIMESTAMPS"]  # inherited
    assert tracer.settings("leveled")["trace_rate"] == "2"
    assert _sampled(tracer, "own", 9) == [3]  # its rate, its one trace
    assert _sampled(tracer, "other", 4) == [2, 4]  # the global rate, counted apart from "own"'s
    tracer.update({"trace_count": "5"})
    assert tracer.settings("leveled")["trace_count"] == "5"  # it did not set its own count: it follows
    assert tracer.settings("own")["trace_count"] == "0"  # it set its own: it keeps it
    tracer.update({"trace_rate": None, "trace_count": None}, model="own")  # null drops an override
    assert tracer.settings("own")["trace_rate"] == "2" and _sampled(tracer, "own", 2) == [2]
    (trace,) = [t for t in (tracer.sample("leveled"), tracer.sample("leveled")) if t is not None]  # rate 2
    assert trace.tensors and not trace.timestamps  # its own level


@pytest.mark.parametrize("changes, words", [
    ({"trace_rate": "0"}, "Unable to parse 'trace_rate'. Expecting value >= 1, got:0"),
    ({"trace_rate": "4294967296"}, "Unable to parse 'trace_rate'. Value out of range: 4294967296"),
    ({"trace_count": "-2"}, "Expecting value >= -1"),
    ({"log_frequency": "often"}, "Unable to parse 'log_frequency'"),
    ({"trace_rate": 5}, "'trace_rate' must be a string"),
    ({"trace_level": "TIMESTAMPS"}, "'trace_level' must be an array of strings"),
    ({"trace_level": ["LOUD"]}, "invalid value for 'trace_level'"),
    ({"trace_level": ["OFF", "TENSORS"]}, "cannot combine OFF with other levels"),
    ({"trace_rate": "5", "trace_count": "-5"}, "trace_count"),  # nothing applies when one key is wrong
])
def test_settings_are_checked_before_any_applies(tmp_path: Path, changes: dict, words: str) -> None:
    tracer = _tracer(tmp_path, trace_rate="7")
    with pytest.raises(PierError, match=words.replace("(", r"\(").replace(".", r"\.")) as refused:
        tracer.update(changes)
    assert refused.value.code is ErrorCode.INVALID_ARG
    assert tracer.settings()["trace_rate"] == "7"


def test_a_trace_file_is_only_named_at_startup(tmp_path: Path) -> None:
    with pytest.raises(PierError, match="can not be updated through network protocol") as refused:
        _tracer(tmp_path).update({"trace_file": "/tmp/elsewhere.json"})
    assert refused.value.code is ErrorCode.UNSUPPORTED
    with pytest.raises(PierError, match="trace file name is not given"):
        Tracer().update({"trace_level": ["TIMESTAMPS"]})
    assert Tracer().update({"trace_rate": "5"})["trace_rate"] == "5"  # without a file, settings still change


def test_traces_are_written_every_log_frequency_and_the_rest_at_shutdown(tmp_path: Path) -> None:
    tracer = _tracer(tmp_path, log_frequency="2")
    for i in range(5):
        trace = tracer.sample("m", f"r{i}")
        assert trace is not None
        trace.start(1)
        tracer.finish(trace)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["trace.json.0", "trace.json.1"]
    tracer.close()
    files = [json.loads((tmp_path / f"trace.json.{n}").read_text()) for n in range(3)]
    assert [[r["request_id"] for r in f if "request_id" in r] for f in files] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    (tmp_path / "once").mkdir()
    once = _tracer(tmp_path / "once")  # log_frequency 0: one file, at shutdown
    for _ in range(3):
        trace = once.sample("m")
        assert trace is not None
        trace.start(1)
        once.finish(trace)
    assert not (tmp_path / "once" / "trace.json").exists()
    once.close()
    assert len([r for r in json.loads((tmp_path / "once" / "trace.json").read_text()) if "model_name" in r]) == 3


def test_trace_config_flags() -> None:
    settings = parse_trace_config(["triton,file=/tmp/t.json", "level=TIMESTAMPS", "level=tensors", "rate=5",
                                   "mode=triton", "count=-1", "log-frequency=10"])
    assert settings == {"trace_file": "/tmp/t.json", "trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "5",
                        "trace_count": "-1", "log_frequency": "10"}
    for item, words in (("opentelemetry,file=x", "unknown setting 'opentelemetry,file'"),
                        ("jaeger,url=x", "trace mode 'jaeger' is not supported"),
                        ("mode=zipkin", "trace mode 'zipkin' is not supported"),
                        ("colour=blue", "unknown setting 'colour=blue'"), ("rate", "unknown setting 'rate'"),
                        ("rate=0", "--trace-config: Unable to parse 'trace_rate'"),
                        ("opentelemetry,bsp_max_queue_size=-1", "must be an unsigned integer"),
                        ("opentelemetry,resource=novalue", "must be key=value"),
                        ("opentelemetry,protocol=thrift", "protocol must be one of http/protobuf, grpc"),
                        ("opentelemetry,bsp_max_export_batch_size=4096", "must not exceed bsp_max_queue_size")):
        with pytest.raises(ValueError, match=words):
            parse_trace_config(["mode=opentelemetry", item] if item.startswith("opentelemetry,") else [item])


def test_opentelemetry_trace_config() -> None:
    """Triton's OpenTelemetry flags: rate=0 allowed there (traceparent only), the triton mode's
    file settings ignored, the opentelemetry items kept in order."""
    settings = parse_trace_config(["mode=opentelemetry", "rate=0", "level=TIMESTAMPS", "triton,file=/tmp/t.json",
                                   "opentelemetry,url=localhost:10000/v1/traces", "opentelemetry,resource=a=b=c",
                                   "opentelemetry,bsp_schedule_delay=100"])
    config = settings.pop("opentelemetry")
    assert settings == {"trace_mode": "opentelemetry", "trace_rate": "0", "trace_level": ["TIMESTAMPS"]}
    assert config.url() == "http://localhost:10000/v1/traces" and config.resource() == {"a": "b=c"}
    assert config.bsp() == {"bsp_max_queue_size": 2048, "bsp_schedule_delay": 100, "bsp_max_export_batch_size": 512}
    assert parse_trace_config(["opentelemetry,url=x"]) == {}  # mode triton: the other mode's items are ignored


ECHO = """name: "echo" backend: "onnxruntime" max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 3 ] } ]
"""
STAGES = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
          "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END", "HTTP_SEND_START",
          "HTTP_SEND_END"]


def test_a_served_request_is_traced_from_its_receive_to_its_send_in_order(tmp_path: Path) -> None:
    async def main() -> None:
        routes = RoutingTable()
        serve(routes, load(ECHO, Toy(lambda r: outputs(tensor("Y", r.inputs[0].data * 2, "INT32")))))
        plane = DataPlane(routes, strict_readiness=False,
                          tracer=_tracer(tmp_path, trace_level=["TIMESTAMPS", "TENSORS"], trace_rate="2"))

        def encode(response: InferenceResponse) -> list[int]:
            return response.outputs[0].data.tolist()

        received = []
        for i in range(3):  # the 2nd is sampled
            request = InferenceRequest("echo", "", [tensor("X", [i, 1, 2], "INT32")], id=f"r{i}")
            received.append(time.perf_counter_ns())
            assert await plane.serve(request, encode, protocol="HTTP", received_ns=received[-1]) == [2 * i, 2, 4]
            assert (request.trace is False) == (i != 1)  # sampled out by its frontend: the plane leaves it be
        plane.tracer.close()
        records = json.loads((tmp_path / "trace.json").read_text())
        head = next(r for r in records if "model_name" in r)
        assert head == {"id": 1, "model_name": "echo", "model_version": 1, "request_id": "r1"}
        stamps = [t for r in records for t in r.get("timestamps", [])]
        assert [t["name"] for t in stamps] == STAGES
        assert stamps[0]["ns"] == received[1]
        assert [t["ns"] for t in stamps] == sorted(t["ns"] for t in stamps)
        tensors = [(r["activity"], r["tensor"]) for r in records if "tensor" in r]
        assert tensors == [("TENSOR_QUEUE_INPUT", {"name": "X", "data": "1,1,2", "shape": "3", "dtype": "INT32"}),
                           ("TENSOR_BACKEND_OUTPUT", {"name": "Y", "data": "2,2,4", "shape": "3", "dtype": "INT32"})]

    asyncio.run(main())
