"""HTTP details clients rely on: raw binary requests, compressed bodies, mixed binary/JSON
outputs, BYTES binary layout, empty-body health answers."""

from __future__ import annotations

import gzip
import json
import struct
import zlib

import numpy as np
import pytest
import requests

from pier.tensors.datatypes import serialize_bytes

pytestmark = pytest.mark.frontends  # raw binary and compressed bodies are relayed after the frontend looks


def test_raw_binary_request(pier):
    """Inference-Header-Content-Length: 0 -> the body is the single input, batch 1, outputs binary."""
    x = np.arange(5, dtype=np.float32)
    r = requests.post(f"{pier.base()}/v2/models/identity_fp32/infer", data=x.tobytes(),
                      headers={"Inference-Header-Content-Length": "0"}, timeout=10)
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    header = json.loads(r.content[:n])
    assert header["outputs"][0]["shape"] == [1, 5]
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 20
    np.testing.assert_array_equal(np.frombuffer(r.content[n:], dtype=np.float32), x)


def test_raw_binary_bytes_request_is_one_element(pier):
    """As Triton (qa L0_http test_byte): for a BYTES input of shape [1] the raw body is the one
    element, with no length prefix; other BYTES shapes cannot be deduced."""
    r = requests.post(f"{pier.base()}/v2/models/bytes_one/infer", data=b"427",
                      headers={"Inference-Header-Content-Length": "0"}, timeout=10)
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    assert r.content[n:] == struct.pack("<I", 3) + b"427"
    r = requests.post(f"{pier.base()}/v2/models/roundtrip_bytes/infer", data=b"427",
                      headers={"Inference-Header-Content-Length": "0"}, timeout=10)
    assert r.status_code == 400 and "the model must have input shape [1]" in r.json()["error"], r.text


def test_raw_binary_request_needs_a_single_input_model(pier):
    r = requests.post(f"{pier.base()}/v2/models/simple/infer", data=b"\0" * 64,
                      headers={"Inference-Header-Content-Length": "0"}, timeout=10)
    assert r.status_code == 400 and "Raw request must only have 1 input" in r.json()["error"]


def test_gzip_and_deflate_request_bodies(pier):
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})
    for encoding, packed in (("gzip", gzip.compress(body.encode())), ("deflate", zlib.compress(body.encode()))):
        r = requests.post(f"{pier.base()}/v2/models/identity_fp32/infer", data=packed,
                          headers={"Content-Encoding": encoding}, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0]


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.slow
def test_gzip_bomb_is_refused_without_inflating_it(pier):
    """A small gzip body that inflates to 512 MiB: a 413 at --http-max-input-size (64 MiB), and the
    server's peak memory grows by far less than the inflated size; it keeps serving."""
    bomb = gzip.compress(b"\0" * (512 << 20), compresslevel=9)
    before = _peak_rss_kib(pier.proc.pid)
    for path in ("/v2/models/identity_fp32/infer", "/v1/completions", "/v2/repository/index"):
        r = requests.post(f"{pier.base()}{path}", data=bomb, headers={"Content-Encoding": "gzip"}, timeout=60)
        assert r.status_code == 413 and "decoded request body exceeds" in r.text, (path, r.status_code, r.text[:200])
    assert _peak_rss_kib(pier.proc.pid) - before < 256 << 10  # KiB: well under the 512 MiB inflated body
    assert requests.get(f"{pier.base()}/v2/health/ready", timeout=5).status_code == 200


def test_compressed_response_when_accepted(pier):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 400], "datatype": "FP32", "data": [0.0] * 400}]}
    r = requests.post(f"{pier.base()}/v2/models/identity_fp32/infer", json=body,
                      headers={"Accept-Encoding": "gzip"}, timeout=10)
    assert r.status_code == 200
    assert r.headers.get("Content-Encoding") == "gzip"
    assert r.json()["outputs"][0]["shape"] == [1, 400]  # requests decompresses transparently


def test_mixed_binary_and_json_outputs_and_bytes_layout(pier):
    strings = [b"ab", b"", "é".encode()]
    blob = serialize_bytes(np.array(strings, dtype=np.object_))
    assert blob == b"".join(struct.pack("<I", len(s)) + s for s in strings)
    header = json.dumps({
        "id": "mixed",
        "inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(blob)}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        "parameters": {"custom_key": "passes through"},
    }).encode()
    r = requests.post(f"{pier.base()}/v2/models/roundtrip_bytes/infer", data=header + blob,
                      headers={"Inference-Header-Content-Length": str(len(header))}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == "application/octet-stream"
    n = int(r.headers["Inference-Header-Content-Length"])
    doc = json.loads(r.content[:n])
    assert doc["id"] == "mixed"
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == len(blob)
    assert r.content[n:] == blob
    # the same output as JSON
    r2 = requests.post(f"{pier.base()}/v2/models/roundtrip_bytes/infer", json={
        "inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "BYTES", "data": ["ab", "", "é"]}]}, timeout=10)
    assert r2.headers["Content-Type"].startswith("application/json")
    assert r2.json()["outputs"][0]["data"] == ["ab", "", "é"]
    assert "id" not in r2.json()  # omitted when the request had none


def test_binary_data_output_request_parameter(pier):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1.5, 2.5]}],
            "parameters": {"binary_data_output": True}}
    r = requests.post(f"{pier.base()}/v2/models/identity_fp32/infer", json=body, timeout=10)
    n = int(r.headers["Inference-Header-Content-Length"])
    assert np.frombuffer(r.content[n:], dtype=np.float32).tolist() == [1.5, 2.5]


def test_health_bodies_are_empty_and_model_ready_codes(pier):
    paths = ("/v2/health/live", "/v2/health/ready", "/v2/models/simple/ready", "/v2/models/simple/versions/1/ready")
    for path in paths:
        r = requests.get(pier.base() + path, timeout=5)
        assert r.status_code == 200 and r.content == b"", path
        assert r.headers["Content-Type"].startswith("text/plain"), path  # as Triton 2.51
    for path in ("/v2/models/nope/ready", "/v2/models/simple/versions/9/ready"):
        r = requests.get(pier.base() + path, timeout=5)
        assert r.status_code == 400 and r.json() == {"error": "Model version not ready"}, path  # Triton's body


def test_non_finite_floats_round_trip_as_json(pier):
    """tritonclient writes NaN/Infinity literals in JSON; Triton reads and writes them too."""
    import tritonclient.http as httpclient

    x = np.array([[np.nan, np.inf, -np.inf, 1.5]], dtype=np.float32)
    client = httpclient.InferenceServerClient(pier.http_url)
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    out_json = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
    result = client.infer("identity_fp32", [inp], outputs=[out_json])
    out = result.as_numpy("OUTPUT0")
    assert np.isnan(out[0, 0]) and out[0, 1] == np.inf and out[0, 2] == -np.inf and out[0, 3] == 1.5


def test_fp32_json_output_is_the_widened_double(pier):
    """Triton writes a float32 output as the double it widens to (0.1f -> 0.10000000149011612), so the
    JSON equals the float32 array's .tolist(), the comparison clients write."""
    x = np.array([0.1, 3.4e38, -1.1754944e-38, 2.5], dtype=np.float32)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                        "data": [0.1, 3.4e38, -1.1754944e-38, 2.5]}]}
    r = requests.post(f"{pier.base()}/v2/models/identity_fp32/infer", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert '"data":[0.10000000149011612,' in r.text, r.text
    assert r.json()["outputs"][0]["data"] == x.tolist()


def test_trace_settings_need_a_trace_file(pier):
    """As Triton 2.51: tracing cannot be switched on without a trace file, and the file is not
    settable over the network (not even to its current value)."""
    url = f"{pier.base()}/v2/trace/setting"
    r = requests.post(url, json={"trace_level": ["TIMESTAMPS"]}, timeout=5)
    assert r.status_code == 400 and "trace file name is not given" in r.json()["error"], r.text
    r = requests.post(url, json={"trace_file": ""}, timeout=5)
    assert r.status_code == 501, r.text
    assert requests.get(url, timeout=5).json()["trace_level"] == ["OFF"]
    assert requests.post(url, json={"trace_rate": "5"}, timeout=5).json()["trace_rate"] == "5"


def test_version_string_is_normalized(pier):
    meta = requests.get(f"{pier.base()}/v2/models/simple/versions/01", timeout=5).json()
    assert meta["versions"] == ["1"]


def test_statistics_lookup_errors(pier):
    r = requests.get(f"{pier.base()}/v2/models/nope/stats", timeout=5)
    assert r.status_code == 400 and "requested model 'nope' is not available" in r.json()["error"]
    r = requests.get(f"{pier.base()}/v2/models/simple/versions/9/stats", timeout=5)
    assert r.status_code == 400 and "requested model version is not available" in r.json()["error"]


def test_cuda_shared_memory_answers_as_triton_without_gpus(pier):
    r = requests.post(pier.base() + "/v2/cudasharedmemory/region/r/register",
                      json={"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 64}, timeout=5)
    assert r.status_code == 400 and "failed to register shared memory region 'r': invalid args" in r.json()["error"]
    assert requests.get(pier.base() + "/v2/cudasharedmemory/status", timeout=5).json() == []
    assert requests.post(pier.base() + "/v2/cudasharedmemory/unregister", timeout=5).status_code == 200


def test_generate_extension_on_an_ordinary_model(pier) -> None:
    body = {"id": "g1", "INPUT0": list(range(16)), "parameters": {"INPUT1": [1] * 16, "custom": "kept"}}
    r = requests.post(f"{pier.base()}/v2/models/simple/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["model_name"] == "simple" and doc["id"] == "g1"
    assert doc["OUTPUT0"] == [i + 1 for i in range(16)] and doc["OUTPUT1"] == [i - 1 for i in range(16)]
    r = requests.post(f"{pier.base()}/v2/models/simple/generate_stream", json=body, timeout=30)
    assert r.status_code == 200 and r.text.startswith("data: ")
    assert json.loads(r.text[len("data: "):].strip())["OUTPUT0"][3] == 4
    r = requests.post(f"{pier.base()}/v2/models/simple/generate", json={"INPUT0": list(range(16))}, timeout=30)
    assert r.status_code == 400 and "INPUT1" in r.json()["error"]
