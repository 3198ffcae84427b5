"""tritonclient HTTP (binary on and off) and gRPC against a real `pier serve`: inference on
`simple`, batch limits, health and metadata calls with the fields the clients read."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.frontends  # infer decoded and encoded in the frontend; metadata, streams relayed


def _simple_inputs(module, batch: int, binary: bool | None = None):
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.full((batch, 16), 3, dtype=np.int32)
    inputs = [module.InferInput("INPUT0", [batch, 16], "INT32"), module.InferInput("INPUT1", [batch, 16], "INT32")]
    for t, v in zip(inputs, (a, b)):
        if binary is None:
            t.set_data_from_numpy(v)
        else:
            t.set_data_from_numpy(v, binary_data=binary)
    return inputs, a, b


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("binary", [True, False])
def test_http_simple(pier, batch, binary):
    client = httpclient.InferenceServerClient(pier.http_url)
    inputs, a, b = _simple_inputs(httpclient, batch, binary)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    result = client.infer("simple", inputs, outputs=outputs, request_id="r1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response["id"] == "r1"
    assert response["model_name"] == "simple" and response["model_version"] == "1"


@pytest.mark.parametrize("batch", [1, 8])
def test_grpc_simple(pier, batch):
    client = grpcclient.InferenceServerClient(pier.grpc_url)
    inputs, a, b = _simple_inputs(grpcclient, batch)
    result = client.infer("simple", inputs, request_id="g1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.get_response().id == "g1"


def test_requested_output_subset(pier):
    client = httpclient.InferenceServerClient(pier.http_url)
    inputs, a, b = _simple_inputs(httpclient, 2)
    result = client.infer("simple", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    gclient = grpcclient.InferenceServerClient(pier.grpc_url)
    ginputs, a, b = _simple_inputs(grpcclient, 2)
    gresult = gclient.infer("simple", ginputs, outputs=[grpcclient.InferRequestedOutput("OUTPUT0")])
    assert [o.name for o in gresult.get_response().outputs] == ["OUTPUT0"]
    np.testing.assert_array_equal(gresult.as_numpy("OUTPUT0"), a + b)


def test_explicit_version(pier):
    client = httpclient.InferenceServerClient(pier.http_url)
    inputs, a, b = _simple_inputs(httpclient, 1)
    result = client.infer("simple", inputs, model_version="1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


def test_batch_over_max_is_rejected(pier):
    client = httpclient.InferenceServerClient(pier.http_url)
    inputs, _, _ = _simple_inputs(httpclient, 9)
    with pytest.raises(InferenceServerException) as err:
        client.infer("simple", inputs)
    assert err.value.status() == "400"
    assert "batch-size must be <= 8" in err.value.message()
    gclient = grpcclient.InferenceServerClient(pier.grpc_url)
    ginputs, _, _ = _simple_inputs(grpcclient, 9)
    with pytest.raises(InferenceServerException) as gerr:
        gclient.infer("simple", ginputs)
    assert gerr.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "batch-size must be <= 8" in gerr.value.message()


def test_health_and_metadata_http(pier):
    client = httpclient.InferenceServerClient(pier.http_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("simple", "7")
    meta = client.get_server_metadata()
    assert meta["name"] == "triton" and meta["version"]  # Triton's --id default
    assert "binary_tensor_data" in meta["extensions"] and "model_configuration" in meta["extensions"]
    # Triton's order; schedule_policy = request priority and timeout parameters (dynamic batcher)
    assert [e for e in meta["extensions"] if e in ("classification", "model_repository", "schedule_policy",
                                                   "model_configuration", "system_shared_memory", "statistics",
                                                   "trace", "logging")] == [
        "classification", "model_repository", "schedule_policy", "model_configuration", "system_shared_memory",
        "statistics", "trace", "logging"]
    mm = client.get_model_metadata("simple")
    assert mm["name"] == "simple" and mm["versions"] == ["1"] and mm["platform"] == "onnxruntime_onnx"
    assert mm["inputs"] == [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
                            {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]}]
    assert [o["name"] for o in mm["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    config = client.get_model_config("simple")
    assert config["name"] == "simple" and config["max_batch_size"] == 8
    assert config["input"][0]["dims"] == [16] and config["input"][0]["data_type"] == "TYPE_INT32"
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    identity = client.get_model_config("identity_fp32")
    assert identity["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert identity["dynamic_batching"]["preferred_batch_size"] == [64]


def test_health_and_metadata_grpc(pier):
    client = grpcclient.InferenceServerClient(pier.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple")
    meta = client.get_server_metadata()
    assert meta.name == "triton" and "binary_tensor_data" in meta.extensions
    mm = client.get_model_metadata("simple")
    assert mm.name == "simple" and list(mm.versions) == ["1"] and mm.platform == "onnxruntime_onnx"
    assert [(i.name, i.datatype, list(i.shape)) for i in mm.inputs] == [
        ("INPUT0", "INT32", [-1, 16]), ("INPUT1", "INT32", [-1, 16])]
    config = client.get_model_config("simple").config
    assert config.name == "simple" and config.max_batch_size == 8
    assert list(config.input[0].dims) == [16]
    as_json = client.get_model_config("identity_fp32", as_json=True)["config"]
    assert as_json["max_batch_size"] == 64
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model: 'nope' is not found" in err.value.message()


def test_statistics_both_protocols(pier):
    client = httpclient.InferenceServerClient(pier.http_url)
    inputs, _, _ = _simple_inputs(httpclient, 2)
    before = client.get_inference_statistics("simple")["model_stats"][0]
    client.infer("simple", inputs)
    after = client.get_inference_statistics("simple")["model_stats"][0]
    assert after["inference_count"] == before["inference_count"] + 2
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    gstats = grpcclient.InferenceServerClient(pier.grpc_url).get_inference_statistics("simple")
    assert gstats.model_stats[0].name == "simple"
    assert gstats.model_stats[0].inference_count >= after["inference_count"]
    everything = client.get_inference_statistics()
    assert {"simple", "identity_fp32"} <= {m["name"] for m in everything["model_stats"]}


def test_grpc_stream_infer(pier):
    client = grpcclient.InferenceServerClient(pier.grpc_url)
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        for i in range(3):
            inputs, _, _ = _simple_inputs(grpcclient, 1)
            client.async_stream_infer("simple", inputs, request_id=f"s{i}")
        client.async_stream_infer("nope", _simple_inputs(grpcclient, 1)[0], request_id="bad")
    finally:
        client.stop_stream()
    assert len(results) == 4
    ok = {r.get_response().id for r, e in results if e is None}
    assert ok == {"s0", "s1", "s2"}
    errors = [e for r, e in results if e is not None]
    assert len(errors) == 1 and "unknown model" in errors[0].message()


def test_grpc_health_service(pier):
    import grpc

    from pier.protocol import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(pier.grpc_url) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_cuda_shared_memory_is_refused_in_tritons_words(pier):
    """No CUDA IPC handle can be registered; the refusal is the one Triton gives a handle it cannot
    open (qa L0_grpc python_grpc_aio_test matches "failed to register shared memory region.*invalid args")."""
    client = grpcclient.InferenceServerClient(pier.grpc_url)
    for name, handle in (("r", base64.b64encode(b"not-a-handle")), ("", b"")):
        with pytest.raises(InferenceServerException) as err:
            client.register_cuda_shared_memory(name, handle, 0, 64)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value
        assert f"failed to register shared memory region '{name}': invalid args" in err.value.message()
    # Nothing CUDA can be registered: status is empty and unregister is a no-op, as on Triton
    # without GPUs (perf_analyzer's shared-memory cleanup calls both).
    assert not client.get_cuda_shared_memory_status().regions
    client.unregister_cuda_shared_memory()


def test_grpc_model_ready_is_false_for_unknown_models(pier):
    client = grpcclient.InferenceServerClient(pier.grpc_url)
    assert client.is_model_ready("nope") is False
    assert client.is_model_ready("simple", "9") is False


def test_grpc_stream_answers_in_request_order(pier):
    client = grpcclient.InferenceServerClient(pier.grpc_url)
    order = []
    client.start_stream(callback=lambda result, error: order.append(
        error.message() if error is not None else result.get_response().id))
    try:
        for i in range(12):
            model = "nope" if i % 3 == 0 else ("simple" if i % 3 == 1 else "identity_fp32")
            if model == "identity_fp32":
                inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
                inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
                inputs = [inp]
            else:
                inputs = _simple_inputs(grpcclient, 1)[0]
            client.async_stream_infer(model, inputs, request_id=f"r{i}")
    finally:
        client.stop_stream()
    assert len(order) == 12
    for i, item in enumerate(order):
        if i % 3 == 0:
            assert "unknown model" in item
        else:
            assert item == f"r{i}"


def test_grpc_stream_with_an_unreadable_message_fails_after_answering_what_came_before(pier):
    """A frame that is not a ModelInferRequest ends the stream with INVALID_ARGUMENT (not a silent
    OK that drops the requests after it); the request read before it still gets its answer."""
    import grpc

    from pier.protocol import grpc_service_pb2 as pb

    def request(rid: str) -> bytes:
        req = pb.ModelInferRequest(model_name="simple", id=rid)
        for name in ("INPUT0", "INPUT1"):
            req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
            req.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
        return req.SerializeToString()

    with grpc.insecure_channel(pier.grpc_url) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                     request_serializer=lambda b: b,
                                     response_deserializer=pb.ModelStreamInferResponse.FromString)
        answers = []
        with pytest.raises(grpc.RpcError) as err:
            for message in call(iter([request("first"), b"\xff\xff\xff", request("third")]), timeout=30):
                answers.append(message)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unable to read a request" in err.value.details()
    assert [a.infer_response.id for a in answers] == ["first"] and not answers[0].error_message
