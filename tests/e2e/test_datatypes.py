"""Every KServe datatype ONNX has round-trips through an identity ONNX model, over HTTP (JSON and
binary tensors) and gRPC (raw contents), with extreme values."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import ROUND_TRIP_TYPES

pytestmark = pytest.mark.frontends  # every datatype crosses the frontend's channel (wire codec)

NUMPY = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
         "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
         "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}


def sample(datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        values = [b"hello", "wörld".encode(), b"", b"a b,c", b"x" * 300, b"last"]
        return np.array(values, dtype=np.object_).reshape(2, 3)
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if datatype == "BF16":  # tritonclient (r26.06+) carries BF16 as ml_dtypes.bfloat16
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="tritonclient needs ml_dtypes for BF16")
        return np.array([[1.0, -2.0, 0.5], [0.0, 3.0e38, -1.5]], dtype=ml_dtypes.bfloat16)
    dt = np.dtype(NUMPY[datatype])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.array([[info.min, info.max, 0], [1, info.max - 1, 7]], dtype=dt)
    info = np.finfo(dt)
    return np.array([[info.min, info.max, 0.0], [-1.5, 3.25, info.tiny]], dtype=dt)


def _check(result_array: np.ndarray, expected: np.ndarray, datatype: str) -> None:
    assert result_array.shape == expected.shape
    if datatype == "BYTES":
        got = [x.encode() if isinstance(x, str) else bytes(x) for x in result_array.reshape(-1)]
        assert got == list(expected.reshape(-1))
    else:
        assert result_array.dtype == expected.dtype
        np.testing.assert_array_equal(result_array, expected)


@pytest.mark.parametrize("datatype", ROUND_TRIP_TYPES)
@pytest.mark.parametrize("binary", [True, False])
def test_http_round_trip(pier, datatype, binary):
    if datatype in ("FP16", "BF16") and not binary:
        pytest.skip(f"{datatype} inputs cannot travel as JSON (Triton refuses them too); JSON outputs: "
                    "test_http_half_precision_output_as_json")
    data = sample(datatype)
    client = httpclient.InferenceServerClient(pier.http_url)
    inp = httpclient.InferInput("INPUT0", list(data.shape), datatype)
    inp.set_data_from_numpy(data, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    result = client.infer(f"roundtrip_{datatype.lower()}", [inp], outputs=[out])
    _check(result.as_numpy("OUTPUT0"), data, datatype)
    assert result.get_output("OUTPUT0")["datatype"] == datatype


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_http_half_precision_output_as_json(pier, datatype):
    """FP16 / BF16 in binary, answer asked for as JSON: JSON numbers (each value widened exactly), as
    for FP32 (Triton refuses with 400; it used to come back binary regardless)."""
    data = sample(datatype)
    client = httpclient.InferenceServerClient(pier.http_url)
    inp = httpclient.InferInput("INPUT0", list(data.shape), datatype)
    inp.set_data_from_numpy(data, binary_data=True)
    result = client.infer(f"roundtrip_{datatype.lower()}", [inp],
                          outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
    out = result.get_output("OUTPUT0")
    assert out["datatype"] == datatype and "binary_data_size" not in out.get("parameters", {})
    assert out["data"] == data.astype(np.float64).reshape(-1).tolist()


def test_http_binary_data_output_is_for_unnamed_outputs(pier):
    """As Triton 2.51: `binary_data_output` sets the format of the outputs a request does not name;
    a named output is JSON unless its own `binary_data` is true."""
    import requests

    inp = {"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1.5, 2.5]}
    url = f"http://{pier.http_url}/v2/models/roundtrip_fp32/infer"
    named = requests.post(url, json={"parameters": {"binary_data_output": True}, "inputs": [inp],
                                     "outputs": [{"name": "OUTPUT0"}]}, timeout=10)
    assert named.status_code == 200 and named.json()["outputs"][0]["data"] == [1.5, 2.5], named.text
    unnamed = requests.post(url, json={"parameters": {"binary_data_output": True}, "inputs": [inp]}, timeout=10)
    header_len = int(unnamed.headers["Inference-Header-Content-Length"])
    assert np.frombuffer(unnamed.content[header_len:], np.float32).tolist() == [1.5, 2.5]


@pytest.mark.parametrize("datatype", ROUND_TRIP_TYPES)
def test_grpc_round_trip(pier, datatype):
    data = sample(datatype)
    client = grpcclient.InferenceServerClient(pier.grpc_url)
    inp = grpcclient.InferInput("INPUT0", list(data.shape), datatype)
    inp.set_data_from_numpy(data)
    result = client.infer(f"roundtrip_{datatype.lower()}", [inp])
    _check(result.as_numpy("OUTPUT0"), data, datatype)
    assert result.get_output("OUTPUT0").datatype == datatype


@pytest.mark.parametrize("datatype", ["BOOL", "INT8", "INT32", "INT64", "UINT32", "UINT64", "FP32", "FP64", "BYTES"])
def test_grpc_typed_contents(pier, datatype):
    """Requests that use typed `contents` instead of raw bytes (as some non-Triton clients do)."""
    import grpc

    from pier.protocol import grpc_service_pb2 as pb
    from pier.protocol import grpc_service_pb2_grpc as pb_grpc

    data = sample(datatype)
    field = {"BOOL": "bool_contents", "INT8": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}[datatype]
    req = pb.ModelInferRequest(model_name=f"roundtrip_{datatype.lower()}")
    t = req.inputs.add(name="INPUT0", datatype=datatype, shape=list(data.shape))
    getattr(t.contents, field).extend(data.reshape(-1).tolist())
    with grpc.insecure_channel(pier.grpc_url) as channel:
        resp = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req)
    assert list(resp.outputs[0].shape) == list(data.shape)
    from pier.tensors.datatypes import from_raw

    got = from_raw(resp.raw_output_contents[0], datatype, list(data.shape), "OUTPUT0")
    _check(got, data, datatype)
