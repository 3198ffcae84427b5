"""Bad input gets a clear 4xx / gRPC status naming the problem, and the server keeps serving.

One table for HTTP (raw bodies via `requests`) and one for gRPC (raw ModelInferRequest through
the stub), run against a server with small body limits so the oversize cases are cheap."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from pier.protocol import grpc_service_pb2 as pb
from pier.protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import start_pier

pytestmark = pytest.mark.frontends  # body limits, parsing and decode errors happen in the frontend

LIMIT = 1 << 20  # 1 MiB


@pytest.fixture(scope="module")
def small_pier(test_repo, tmp_path_factory):
    server = start_pier([test_repo], f"--http-max-input-size={LIMIT}", f"--grpc-max-message-size={LIMIT}",
                        log_path=tmp_path_factory.mktemp("bad") / "pier.log")
    yield server
    assert server.stop() == 0


def _inp(name="INPUT0", shape=(1, 16), datatype="INT32", data=None):
    n = int(np.prod(shape))
    return {"name": name, "shape": list(shape), "datatype": datatype,
            "data": list(range(n)) if data is None else data}


def _body(*inputs):
    return json.dumps({"inputs": list(inputs)}).encode()


GOOD = _body(_inp("INPUT0"), _inp("INPUT1"))
BINARY_HEADER = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
    {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
]}).encode()

# 2^40 elements declared, 4 bytes sent: refused before anything is sized from the shape
BYTES_HEADER = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 2**40], "datatype": "BYTES", "parameters": {"binary_data_size": 4}}]}).encode()

TWO_BYTES_HEADER = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 2], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}]}).encode()

NOT_UTF8_HEADER = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}]}).encode()

# (case, method, path, body, headers, status, message fragment)
HTTP_CASES = [
    ("malformed JSON", "POST", "/v2/models/simple/infer", b"garbage{", {}, 400, "failed to parse the request JSON"),
    ("index ready not a boolean", "POST", "/v2/repository/index", b'{"ready": "yes"}', {}, 400,
     "'ready' must be a boolean"),
    ("JSON not an object", "POST", "/v2/models/simple/infer", b"[1,2]", {}, 400, "must be an object"),
    ("no inputs", "POST", "/v2/models/simple/infer", b'{"inputs": []}', {}, 400,
     "expected 2 inputs but got 0 inputs for model 'simple'"),
    ("inputs missing", "POST", "/v2/models/simple/infer", b'{"id": "x"}', {}, 400, "'inputs' array"),
    ("deeply nested JSON", "POST", "/v2/models/simple/infer", b"[" * 100000 + b"]" * 100000, {}, 400,
     "failed to parse"),
    ("truncated binary body", "POST", "/v2/models/simple/infer", BINARY_HEADER + b"\0" * 70,
     {"Inference-Header-Content-Length": str(len(BINARY_HEADER))}, 400,
     "unexpected size for input 'INPUT1', expecting 58 additional bytes for model 'simple'"),
    ("trailing binary bytes", "POST", "/v2/models/simple/infer", BINARY_HEADER + b"\0" * 130,
     {"Inference-Header-Content-Length": str(len(BINARY_HEADER))}, 400, "unexpected additional input data"),
    ("binary size mismatch", "POST", "/v2/models/simple/infer",
     BINARY_HEADER.replace(b'"binary_data_size": 64}}]', b'"binary_data_size": 60}}]') + b"\0" * 124,
     {"Inference-Header-Content-Length": str(len(BINARY_HEADER))}, 400,
     "input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 60"),
    ("header length out of range", "POST", "/v2/models/simple/infer", GOOD,
     {"Inference-Header-Content-Length": str(len(GOOD) + 5)}, 400, "inference header size should be in range"),
    ("wrong datatype", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", datatype="FP32"), _inp("INPUT1")), {}, 400, "data-type is 'FP32'"),
    ("unknown datatype", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", datatype="INT33"), _inp("INPUT1")), {}, 400, "invalid datatype"),
    ("wrong shape", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", shape=(1, 15)), _inp("INPUT1")), {}, 400, "unexpected shape for input 'INPUT0'"),
    ("wrong element count", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", data=list(range(15))), _inp("INPUT1")), {}, 400,
     "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    ("ragged data", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", data=[list(range(8)), list(range(7))]), _inp("INPUT1")), {}, 400,
     "Unable to parse 'data': Shape does not match true shape of 'data' field (input 'INPUT0': arrays must be "
     "regular"),
    ("string data for INT32", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", data=["a"] * 16), _inp("INPUT1")), {}, 400, "expected INT32 values"),
    ("data nested past 64 levels", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", data=json.loads("[" * 70 + "1" + "]" * 70)), _inp("INPUT1")), {}, 400,
     "nested more than 64 deep"),
    ("booleans for INT32", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", data=[True] * 16), _inp("INPUT1")), {}, 400, "expected INT32 values, got booleans"),
    ("number for BYTES", "POST", "/v2/models/roundtrip_bytes/infer",
     _body(_inp("INPUT0", shape=(1, 2), datatype="BYTES", data=["a", 5])), {}, 400,
     "elements must be strings, got a number"),
    ("value out of range", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", data=[2**40] * 16), _inp("INPUT1")), {}, 400, "out of range for INT32"),
    ("negative dim", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", shape=(-1, 16), data=[]), _inp("INPUT1")), {}, 400, "negative dimension"),
    ("absurd shape", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", shape=(1, 10**15), data=[1]), _inp("INPUT1")), {}, 400, "Shape does not match true shape"),
    ("batch of zero", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", shape=(0, 16), data=[]), _inp("INPUT1")), {}, 400, "batch-size must be >= 1"),
    ("more than 64 dims", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", shape=(1,) * 65, data=[1]), _inp("INPUT1")), {}, 400, "at most 64 are supported"),
    ("unpaired surrogate", "POST", "/v2/models/simple/infer",
     b'{"inputs":[{"name":"\\ud800","shape":[1,16],"datatype":"INT32","data":[0]}]}', {}, 400,
     "failed to parse the request JSON"),
    ("BYTES shape past its buffer", "POST", "/v2/models/roundtrip_bytes/infer", BYTES_HEADER + b"\0" * 4,
     {"Inference-Header-Content-Length": str(len(BYTES_HEADER))}, 400,
     f"expected {2**40} string elements for inference input 'INPUT0' for model 'roundtrip_bytes', got 1"),
    ("BYTES length indicator cut short", "POST", "/v2/models/roundtrip_bytes/infer", TWO_BYTES_HEADER + b"\0" * 6,
     {"Inference-Header-Content-Length": str(len(TWO_BYTES_HEADER))}, 400,
     "incomplete string length indicator for inference input 'INPUT0' for model 'roundtrip_bytes', expecting 4 "
     "bytes but only 2 bytes available"),
    ("BYTES not UTF-8 for an ONNX string tensor", "POST", "/v2/models/roundtrip_bytes/infer",
     NOT_UTF8_HEADER + b"\x02\0\0\0\xff\xfe", {"Inference-Header-Content-Length": str(len(NOT_UTF8_HEADER))}, 400,
     "holds an element that is not UTF-8 text"),
    ("FP16 as JSON", "POST", "/v2/models/roundtrip_fp16/infer",
     _body(_inp("INPUT0", shape=(1, 2), datatype="FP16", data=[1.0, 2.0])), {}, 400, "binary data format"),
    ("missing input", "POST", "/v2/models/simple/infer", _body(_inp("INPUT0")), {}, 400,
     "missing required input(s) ['INPUT1']"),
    ("unknown input", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0"), _inp("BAD")), {}, 400, "unexpected inference input 'BAD' for model 'simple'"),
    ("too many inputs", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0"), _inp("INPUT1"), _inp("BAD")), {}, 400, "expected 2 inputs but got 3 inputs"),
    ("duplicate input", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0"), _inp("INPUT0")), {}, 400, "input 'INPUT0' already exists in request"),
    ("duplicate input past the count", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0"), _inp("INPUT1"), _inp("INPUT0")), {}, 400, "input 'INPUT0' already exists in request"),
    ("second input without the batch dim", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0"), _inp("INPUT1", shape=(16,))), {}, 400,
     "input 'INPUT1' batch size does not match other inputs for 'simple'"),
    ("data and binary_data_size", "POST", "/v2/models/simple/infer",
     _body({**_inp("INPUT0"), "parameters": {"binary_data_size": 64}}, _inp("INPUT1")), {}, 400,
     "Input must set only one of the following fields"),
    ("nested parameter value", "POST", "/v2/models/simple/infer",
     json.dumps({"inputs": [_inp("INPUT0"), _inp("INPUT1")], "parameters": {"foo": {"a": 1}}}).encode(), {}, 400,
     "parameter 'foo' has invalid type"),
    ("priority not an integer", "POST", "/v2/models/simple/infer",
     json.dumps({"inputs": [_inp("INPUT0"), _inp("INPUT1")], "parameters": {"priority": "high"}}).encode(), {},
     400, "invalid value type for 'priority' parameter"),
    ("unsupported content encoding", "POST", "/v2/models/simple/infer", GOOD, {"Content-Encoding": "br"}, 501,
     "Unsupported compression type"),
    ("gzip header, plain body", "POST", "/v2/models/simple/infer", GOOD, {"Content-Encoding": "gzip"}, 400,
     "failed to read the request body"),
    ("unknown output", "POST", "/v2/models/simple/infer",
     json.dumps({"inputs": [_inp("INPUT0"), _inp("INPUT1")], "outputs": [{"name": "NOPE"}]}).encode(), {}, 400,
     "unexpected inference output 'NOPE'"),
    ("reserved parameter", "POST", "/v2/models/simple/infer",
     json.dumps({"inputs": [_inp("INPUT0"), _inp("INPUT1")], "parameters": {"triton_x": 1}}).encode(), {}, 400,
     "reserved"),
    ("non-ASCII digit version", "POST", "/v2/models/simple/versions/\u0661/infer", GOOD, {}, 404, "Not Found"),
    ("unknown model", "POST", "/v2/models/nope/infer", GOOD, {}, 404, "Request for unknown model: 'nope' is not found"),
    ("unknown version", "POST", "/v2/models/simple/versions/7/infer", GOOD, {}, 404,
     "Request for unknown model: 'simple' version 7 is not found"),
    ("unknown model metadata", "GET", "/v2/models/nope", None, {}, 404, "Request for unknown model"),
    ("unknown model config", "GET", "/v2/models/nope/config", None, {}, 404, "Request for unknown model"),
    ("oversized JSON", "POST", "/v2/models/simple/infer", b" " * (LIMIT + 1), {}, 413,
     "exceeds the maximum allowed value of 1048576"),
    ("empty tensor of an impossible shape", "POST", "/v2/models/simple/infer",
     _body(_inp("INPUT0", shape=(2**62, 0), data=[]), _inp("INPUT1")), {}, 400, "larger than any tensor can be"),
    ("header value not UTF-8", "POST", "/v2/models/simple/infer", GOOD, {"Content-Encoding": "\xffzip"}, 501,
     "Unsupported compression type '\\udcffzip'"),
    ("binary header length not UTF-8", "POST", "/v2/models/simple/infer", GOOD,
     {"Inference-Header-Content-Length": "\xff1"}, 400, "Inference-Header-Content-Length"),
    ("shared memory key with NUL", "POST", "/v2/systemsharedmemory/region/r/register",
     json.dumps({"key": "/a\u0000b", "offset": 0, "byte_size": 16}).encode(), {}, 400,
     "Unable to open shared memory region"),
    ("wrong verb", "GET", "/v2/models/simple/infer", None, {}, 405, "Method Not Allowed"),
    ("unknown path", "GET", "/v2/nothing/here", None, {}, 404, "Not Found"),
]


def _assert_simple_still_works(server) -> None:
    r = requests.post(f"{server.base()}/v2/models/simple/infer", data=GOOD, timeout=10)
    assert r.status_code == 200, r.text
    out = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert out["OUTPUT0"] == [2 * i for i in range(16)] and out["OUTPUT1"] == [0] * 16


@pytest.mark.parametrize("case,method,path,body,headers,status,fragment", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(small_pier, case, method, path, body, headers, status, fragment):
    r = requests.request(method, f"{small_pier.base()}{path}", data=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert fragment in r.json()["error"], r.json()["error"]
    _assert_simple_still_works(small_pier)


@pytest.mark.parametrize("count", [15, 18])
def test_json_data_of_the_wrong_length_answers_tritons_exact_body(small_pier, count):
    """qa L0_http test.sh greps the whole body: {"error":"<Triton's words>"} and nothing else."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16],
                                   "data": list(range(1, count + 1))}]})
    r = requests.post(f"{small_pier.base()}/v2/models/simple/infer", data=body, timeout=10)
    assert r.status_code == 400
    assert r.content == b'{"error":"Unable to parse \'data\': Shape does not match true shape of \'data\' field"}'


def _req(model="simple", version="", inputs=(("INPUT0", "INT32", (1, 16)), ("INPUT1", "INT32", (1, 16))),
         raw=None, outputs=()):
    req = pb.ModelInferRequest(model_name=model, model_version=version)
    for name, dt, shape in inputs:
        req.inputs.add(name=name, datatype=dt, shape=list(shape))
    if raw is None:
        raw = [np.arange(int(np.prod(s)), dtype=np.int32).tobytes() for _, _, s in inputs]
    req.raw_input_contents.extend(raw)
    for name in outputs:
        req.outputs.add(name=name)
    return req


def _typed_short():
    req = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        t = req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        t.contents.int_contents.extend(range(15))
    return req


def _typed_mixed():
    req = _typed_short()
    for t in req.inputs:
        t.contents.int_contents.append(0)
        t.contents.fp32_contents.append(1.0)
    return req


def _contents_and_raw():
    """grpc_explicit_int_content_client's mistake: INPUT0 as typed contents, INPUT1 as raw bytes."""
    req = _req(raw=[np.arange(16, dtype=np.int32).tobytes()])
    req.inputs[0].contents.int_contents.extend(range(16))
    return req


def _strings(count: int, shape=(1, 16)):
    """L0_input_validation test_input_string_shape_validation: two BYTES inputs whose shape says 16
    strings while the buffers hold `count`; both are named (Triton names one, INPUT1)."""
    buffer = b"".join(len(s).to_bytes(4, "little") + s for s in (str(i).encode() for i in range(count)))
    return _req(model="roundtrip_bytes", inputs=(("INPUT0", "BYTES", shape), ("INPUT1", "BYTES", shape)),
                raw=[buffer, buffer])


def _with_param(req, key, value):
    if isinstance(value, int):
        req.parameters[key].int64_param = value
    else:
        req.parameters[key].string_param = value
    return req


GRPC_CASES = [
    ("BYTES with fewer strings than its shape", _strings(14), grpc.StatusCode.INVALID_ARGUMENT,
     "expected 16 string elements for inference input 'INPUT0' for model 'roundtrip_bytes', got 14; "
     "[request id: <id_unknown>] expected 16 string elements for inference input 'INPUT1' for model "
     "'roundtrip_bytes', got 14"),
    ("BYTES with more strings than its shape", _strings(18), grpc.StatusCode.INVALID_ARGUMENT,
     "unexpected number of string elements 17 for inference input 'INPUT1' for model 'roundtrip_bytes', "
     "expecting 16"),
    ("raw count mismatch", _req(raw=[b"\0" * 64]), grpc.StatusCode.INVALID_ARGUMENT,
     "unable to find data for input tensor 'INPUT1'"),
    ("truncated raw input", _req(raw=[b"\0" * 64, b"\0" * 10]), grpc.StatusCode.INVALID_ARGUMENT,
     "input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 10"),
    ("wrong datatype", _req(inputs=(("INPUT0", "FP32", (1, 16)), ("INPUT1", "INT32", (1, 16)))),
     grpc.StatusCode.INVALID_ARGUMENT, "data-type is 'FP32'"),
    ("wrong shape", _req(inputs=(("INPUT0", "INT32", (1, 15)), ("INPUT1", "INT32", (1, 16)))),
     grpc.StatusCode.INVALID_ARGUMENT, "unexpected shape for input 'INPUT0'"),
    ("wrong element count", _typed_short(), grpc.StatusCode.INVALID_ARGUMENT, "unexpected number of elements"),
    ("absurd shape", _req(inputs=(("INPUT0", "INT32", (1, 10**15)), ("INPUT1", "INT32", (1, 16))),
                          raw=[b"\0" * 64, b"\0" * 64]),
     grpc.StatusCode.INVALID_ARGUMENT, "input byte size mismatch"),
    ("more than 64 dims", _req(inputs=(("INPUT0", "INT32", (1,) * 65), ("INPUT1", "INT32", (1, 16)))),
     grpc.StatusCode.INVALID_ARGUMENT, "at most 64 are supported"),
    ("empty tensor of an impossible shape", _req(inputs=(("INPUT0", "INT32", (0, 2**62)), ("INPUT1", "INT32", (1, 16))),
                                                 raw=[b"", b"\0" * 64]),
     grpc.StatusCode.INVALID_ARGUMENT, "larger than any tensor can be"),
    ("missing input", _req(inputs=(("INPUT0", "INT32", (1, 16)),)), grpc.StatusCode.INVALID_ARGUMENT,
     "missing required input(s) ['INPUT1']"),
    ("unknown input", _req(inputs=(("INPUT0", "INT32", (1, 16)), ("INPUT1", "INT32", (1, 16)),
                                   ("BAD", "INT32", (1, 16)))),
     grpc.StatusCode.INVALID_ARGUMENT, "expected 2 inputs but got 3 inputs"),
    ("unknown input name", _req(inputs=(("INPUT0", "INT32", (1, 16)), ("BAD", "INT32", (1, 16)))),
     grpc.StatusCode.INVALID_ARGUMENT, "unexpected inference input 'BAD'"),
    ("typed contents of another type", _typed_mixed(), grpc.StatusCode.INVALID_ARGUMENT,
     "unexpected explicit tensor data for input tensor 'INPUT0'"),
    ("priority as a string", _with_param(_req(), "priority", "high"), grpc.StatusCode.INVALID_ARGUMENT,
     "invalid value type for 'priority' parameter"),
    ("negative priority", _with_param(_req(), "priority", -1), grpc.StatusCode.INVALID_ARGUMENT,
     "invalid value for 'priority' parameter, expected value >= 0."),
    ("unknown output", _req(outputs=("NOPE",)), grpc.StatusCode.INVALID_ARGUMENT, "unexpected inference output"),
    ("unknown model", _req(model="nope"), grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'nope' is not found"),
    ("empty model name", _req(model=""), grpc.StatusCode.NOT_FOUND, "Request for unknown model: '' is not found"),
    ("non-ASCII digit version", _req(version="\u0661"), grpc.StatusCode.INVALID_ARGUMENT,
     "failed to get model version from specified version string '\u0661' (details: stol), version should be an "
     "integral value > 0"),
    ("contents and raw_input_contents", _contents_and_raw(), grpc.StatusCode.INVALID_ARGUMENT,
     "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'"),
    ("unknown version", _req(version="7"), grpc.StatusCode.NOT_FOUND, "version 7 is not found"),
    ("oversized message", _req(raw=[b"\0" * (LIMIT + 10), b"\0" * 64]), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
]


@pytest.mark.parametrize("case,request_msg,code,fragment", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(small_pier, case, request_msg, code, fragment):
    options = [("grpc.max_send_message_length", 1 << 28)]
    with grpc.insecure_channel(small_pier.grpc_url, options=options) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request_msg, timeout=30)
    assert err.value.code() == code, err.value.details()
    assert fragment in err.value.details(), err.value.details()
    client = grpcclient.InferenceServerClient(small_pier.grpc_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)


def test_grpc_version_that_is_not_an_integer(small_pier):
    """Triton answers INVALID_ARGUMENT on every model RPC, ModelReady included (which answers an
    unknown model or version with ready=false)."""
    message = "failed to get model version from specified version string 'wrong_specification'"
    client = grpcclient.InferenceServerClient(small_pier.grpc_url)
    for call in (lambda: client.is_model_ready("simple", "wrong_specification"),
                 lambda: client.is_model_ready("nope", "wrong_specification"),
                 lambda: client.get_model_metadata("simple", "wrong_specification"),
                 lambda: client.get_model_config("simple", "wrong_specification")):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and message in err.value.message()
    assert client.is_model_ready("simple", "1") and not client.is_model_ready("simple", "7")
    assert not client.is_model_ready("nope")


def test_grpc_repository_index_of_a_named_repository_is_unimplemented(small_pier):
    with grpc.insecure_channel(small_pier.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.RepositoryIndex(pb.RepositoryIndexRequest(repository_name="x"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "'repository_name' specification is not supported" in err.value.details()
        assert any(m.name == "simple" for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10).models)


def test_binary_tensor_data_is_not_bounded_by_the_json_limit(small_pier):
    """--http-max-input-size bounds the JSON header only, as in Triton: a 4 MiB binary tensor
    passes a server whose limit is 1 MiB."""
    x = np.arange(1 << 20, dtype=np.float32).reshape(1, -1)
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    r = requests.post(f"{small_pier.base()}/v2/models/identity_fp32/infer", data=header + x.tobytes(),
                      headers={"Inference-Header-Content-Length": str(len(header))}, timeout=60)
    assert r.status_code == 200, r.text[:200]
    n = int(r.headers["Inference-Header-Content-Length"])
    np.testing.assert_array_equal(np.frombuffer(r.content[n:], dtype=np.float32), x.reshape(-1))


def test_malformed_http_is_a_400_and_one_quiet_line(small_pier):
    """A request aiohttp cannot parse gets its 400 without an ERROR traceback in the log (any client
    could flood it); the server keeps serving. That includes a request with both Content-Length
    and Transfer-Encoding (what `requests` sends for qa L0_http test_content_encoding_chunked_manually,
    which Triton serves): RFC 9112 lets a server refuse it, and Pier does, since the two framings
    disagreeing is how requests are smuggled past a proxy (docs/triton-extensions.md)."""
    import socket

    both = b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n"
    for raw, says in ((b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", b""),
                      (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                       b""),
                      (both + b"\r\n0\r\n\r\n", b"can't be present with")):
        with socket.create_connection(("127.0.0.1", small_pier.http_port), timeout=10) as sock:
            sock.sendall(raw)
            answer = sock.recv(4096)
            assert answer.split(b" ")[1] == b"400" and says in answer, answer
    _assert_simple_still_works(small_pier)
    log = small_pier.log()
    assert "Traceback" not in log and "Error handling request" not in log, log[-2000:]


def test_grpc_message_that_does_not_parse_is_invalid_argument(small_pier):
    """grpc itself answers UNKNOWN to a body its parser rejects, and logs a traceback each time."""
    with grpc.insecure_channel(small_pier.grpc_url) as channel:
        for method in ("ModelInfer", "ModelMetadata", "RepositoryIndex"):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as err:
                call(b"\xff\xff\xff", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "unable to parse the request" in err.value.details()
    assert "DecodeError" not in small_pier.log()
