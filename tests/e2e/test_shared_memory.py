"""Triton's system shared memory extension against a real `pier serve`, driven by tritonclient
(HTTP and gRPC) and its own shared-memory utilities: inputs read from and outputs written to
registered regions (mixed with ordinary tensors), status and unregister, and the errors Triton
gives (checked against Triton 2.51), answered as 4xx where Triton says 500. perf_analyzer's
`--shared-memory system` mode runs too."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, serialize_byte_tensor

pytestmark = pytest.mark.frontends  # a request naming a region is relayed (and its rate-limit token refunded)

PA = Path(os.environ.get("PERF_ANALYZER", Path.home() / "opt/perf-analyzer/perf_analyzer"))
CLIENTS = {"http": httpclient, "grpc": grpcclient}


class Regions:
    """Shared-memory regions made with tritonclient's utilities; destroyed (and unregistered) at the end."""

    def __init__(self, pier) -> None:
        self.http = httpclient.InferenceServerClient(pier.http_url)
        self.handles: list = []
        self.names: list[str] = []

    def make(self, size: int, register_as: str | None = None):
        key = f"/pier_test_{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key, key, size)
        self.handles.append(handle)
        if register_as is not None:
            self.http.register_system_shared_memory(register_as, key, size)
            self.names.append(register_as)
        return handle, key

    def close(self) -> None:
        for name in self.names:
            self.http.unregister_system_shared_memory(name)
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions(pier):
    r = Regions(pier)
    yield r
    r.close()


def client(pier, protocol: str):
    return CLIENTS[protocol].InferenceServerClient(pier.http_url if protocol == "http" else pier.grpc_url)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_in_shared_memory(pier, regions, protocol):
    mod, c = CLIENTS[protocol], client(pier, protocol)
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 5, dtype=np.int32)
    h_in, _ = regions.make(a.nbytes, register_as=f"in_{protocol}")
    h_out, _ = regions.make(256, register_as=f"out_{protocol}")
    shm.set_shared_memory_region(h_in, [a])
    in0 = mod.InferInput("INPUT0", [2, 16], "INT32")
    in0.set_shared_memory(f"in_{protocol}", a.nbytes)  # INPUT0 from shared memory, INPUT1 sent as usual
    in1 = mod.InferInput("INPUT1", [2, 16], "INT32")
    in1.set_data_from_numpy(b)
    out0 = mod.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory(f"out_{protocol}", a.nbytes, offset=64)  # OUTPUT0 into shared memory at 64
    out1 = mod.InferRequestedOutput("OUTPUT1")
    result = c.infer("simple", [in0, in1], outputs=[out0, out1])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    written = shm.get_contents_as_numpy(h_out, np.int32, [2, 16], offset=64)
    np.testing.assert_array_equal(written, a + b)
    response = result.get_response()
    if protocol == "http":  # the output in shared memory: name, datatype and shape, no data
        assert response["outputs"][0] == {"name": "OUTPUT0", "datatype": "INT32", "shape": [2, 16]}
    else:  # as Triton: an empty raw entry keeps raw_output_contents aligned with outputs
        assert response.outputs[0].name == "OUTPUT0" and list(response.outputs[0].shape) == [2, 16]
        assert list(response.raw_output_contents) == [b"", (a - b).tobytes()]
    # The client may rewrite a region between requests: the next request reads the new contents.
    shm.set_shared_memory_region(h_in, [a * 2])
    c.infer("simple", [in0, in1], outputs=[out0, out1])
    np.testing.assert_array_equal(shm.get_contents_as_numpy(h_out, np.int32, [2, 16], offset=64), a * 2 + b)
    # Answered requests no longer hold their regions (a request in flight would: see test_shm_manager).
    regions.http.unregister_system_shared_memory(f"in_{protocol}")
    regions.http.unregister_system_shared_memory(f"out_{protocol}")
    regions.names.clear()


def test_bytes_tensors_in_shared_memory(pier, regions):
    values = np.array([[b"alpha", b"", b"\xce\xbb unicode"]], dtype=np.object_)
    blob = serialize_byte_tensor(values).item()
    h_in, _ = regions.make(len(blob), register_as="bytes_in")
    h_out, _ = regions.make(len(blob), register_as="bytes_out")
    shm.set_shared_memory_region(h_in, [np.frombuffer(blob, dtype=np.uint8)])  # the 4-byte-length layout
    c = grpcclient.InferenceServerClient(pier.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 3], "BYTES")
    inp.set_shared_memory("bytes_in", len(blob))
    out = grpcclient.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("bytes_out", len(blob))
    c.infer("roundtrip_bytes", [inp], outputs=[out])
    got = shm.get_contents_as_numpy(h_out, np.uint8, [len(blob)]).tobytes()
    assert deserialize_bytes_tensor(got).tolist() == values.ravel().tolist()


def test_status_register_and_unregister(pier, regions):
    h = httpclient.InferenceServerClient(pier.http_url)
    g = grpcclient.InferenceServerClient(pier.grpc_url)
    assert "system_shared_memory" in h.get_server_metadata()["extensions"]
    _, key = regions.make(128)
    h.register_system_shared_memory("status_a", key, 64, offset=32)
    g.register_system_shared_memory("status_b", regions.make(64)[1], 64)
    assert {"name": "status_a", "key": key, "offset": 32, "byte_size": 64} in h.get_system_shared_memory_status()
    assert h.get_system_shared_memory_status("status_a") == [
        {"name": "status_a", "key": key, "offset": 32, "byte_size": 64}]
    grpc_status = g.get_system_shared_memory_status().regions
    assert grpc_status["status_a"].key == key and grpc_status["status_a"].offset == 32
    assert grpc_status["status_b"].byte_size == 64
    with pytest.raises(InferenceServerException, match="already in manager"):
        g.register_system_shared_memory("status_a", key, 64)
    h.unregister_system_shared_memory("status_a")
    g.unregister_system_shared_memory("status_b")
    h.unregister_system_shared_memory("never_registered")  # as Triton: not an error
    names = {r["name"] for r in h.get_system_shared_memory_status()}
    assert not names & {"status_a", "status_b"}
    r = requests.get(f"{pier.base()}/v2/systemsharedmemory/region/status_a/status", timeout=10)
    assert r.status_code == 404 and r.json()["error"] == "Unable to find system shared memory region: 'status_a'"


def _post(pier, path: str, body) -> requests.Response:
    return requests.post(f"{pier.base()}{path}", json=body, timeout=10)


def test_register_errors_are_clear_4xx(pier, regions, tmp_path):
    _, key = regions.make(16)
    reg = "/v2/systemsharedmemory/region/bad/register"
    for body, status, text in (
        ({"key": "/pier_no_such_key", "offset": 0, "byte_size": 8}, 400,
         "Unable to open shared memory region: '/pier_no_such_key'"),
        ({"key": "/../etc/passwd", "offset": 0, "byte_size": 8}, 400, "Unable to open shared memory region"),
        ({"key": key, "offset": 0, "byte_size": 64}, 400,
         "failed to register shared memory region 'bad': invalid args"),
        ({"key": key, "offset": 16, "byte_size": 8}, 400, "invalid args"),
        ({"offset": 0, "byte_size": 8}, 400, "Shared memory register request has no 'key' field"),
        ({"key": key}, 400, "Shared memory register request has no 'byte_size' field"),
        ({"key": key, "offset": -1, "byte_size": 8}, 400, "'offset' must be a non-negative integer"),
        ({"key": key, "offset": 0, "byte_size": "8"}, 400, "'byte_size' must be a non-negative integer"),
    ):
        r = _post(pier, reg, body)
        assert r.status_code == status and text in r.json()["error"], (body, r.text)
    # A key that is a symlink out of /dev/shm is refused, not followed.
    link = Path("/dev/shm") / f"pier_test_link_{uuid.uuid4().hex[:8]}"
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    link.symlink_to(secret)
    try:
        r = _post(pier, reg, {"key": "/" + link.name, "offset": 0, "byte_size": 8})
        assert r.status_code == 400 and "Unable to open" in r.json()["error"], r.text
    finally:
        link.unlink()
    r = _post(pier, "/v2/systemsharedmemory/region/no_offset/register", {"key": key, "byte_size": 16})
    assert r.status_code == 200, r.text  # as Triton: the offset defaults to 0
    regions.names.append("no_offset")
    # gRPC answers INTERNAL for a key it cannot open, as Triton (qa L0_grpc python_grpc_aio_test
    # compares "[StatusCode.INTERNAL] Unable to open shared memory region: ''"); HTTP keeps the 400.
    g = grpcclient.InferenceServerClient(pier.grpc_url)
    for name, missing in (("bad", "/pier_nope"), ("", "")):
        with pytest.raises(InferenceServerException) as err:
            g.register_system_shared_memory(name, missing, 0)
        assert err.value.status() == "StatusCode.INTERNAL", err.value
        assert f"Unable to open shared memory region: '{missing}'" in err.value.message(), err.value
    with pytest.raises(InferenceServerException) as err:
        g.register_system_shared_memory("bad", key, 64)  # a real key, too large a window: invalid args
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value


def _identity_body(in_params: dict, out_params: dict | None = None) -> dict:
    body: dict = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": in_params}]}
    if out_params is not None:
        body["outputs"] = [{"name": "OUTPUT0", "parameters": out_params}]
    return body


def test_inference_errors_name_the_problem(pier, regions):
    h_in, _ = regions.make(128, register_as="err_in")
    regions.make(16, register_as="err_small")
    shm.set_shared_memory_region(h_in, [np.arange(16, dtype=np.float32)])
    ok_in = {"shared_memory_region": "err_in", "shared_memory_byte_size": 64}
    url = "/v2/models/identity_fp32/infer"
    for in_params, out_params, status, text in (
        ({"shared_memory_region": "nope", "shared_memory_byte_size": 64}, None, 404,
         "Unable to find shared memory region: 'nope'"),
        ({"shared_memory_region": "err_in", "shared_memory_byte_size": 60}, None, 400,
         "input byte size mismatch for input 'INPUT0' for model 'identity_fp32'. Expected 64, got 60"),
        ({"shared_memory_region": "err_in", "shared_memory_byte_size": 64, "shared_memory_offset": 100}, None, 400,
         "Invalid offset + byte size for shared memory region: 'err_in'"),
        ({"shared_memory_region": 5, "shared_memory_byte_size": 64}, None, 400,
         "Unable to parse 'shared_memory_region'"),
        ({"shared_memory_region": "err_in", "shared_memory_byte_size": "64"}, None, 400,
         "Unable to parse 'shared_memory_byte_size'"),
        (ok_in, {"shared_memory_region": "err_small", "shared_memory_byte_size": 64}, 400,
         "Invalid offset + byte size for shared memory region: 'err_small'"),
        (ok_in, {"shared_memory_region": "err_in", "shared_memory_byte_size": 64, "shared_memory_offset": 2**64 - 32},
         400, "Invalid offset for shared memory region: 'err_in'"),  # qa test_infer_offset_out_of_bound
        (ok_in, {"shared_memory_region": "err_in", "shared_memory_byte_size": 64, "shared_memory_offset": 128}, 400,
         "Invalid offset for shared memory region: 'err_in'"),
        (ok_in, {"shared_memory_region": "err_small", "shared_memory_byte_size": 16}, 400,
         "shared memory size specified with the request for output 'OUTPUT0' (16 bytes) should be at least 64 "
         "bytes to hold the results"),
        (ok_in, {"shared_memory_region": "err_in", "shared_memory_byte_size": 64, "binary_data": True}, 400,
         "Output can't set both 'shared_memory_region' and 'binary_data'"),
        (ok_in, {"shared_memory_region": "err_in", "shared_memory_byte_size": 64, "classification": 2}, 400,
         "Output can't set both 'shared_memory_region' and 'classification'"),
    ):
        r = _post(pier, url, _identity_body(in_params, out_params))
        assert r.status_code == status and text in r.json()["error"], (in_params, out_params, r.text)
    body = _identity_body(ok_in)
    body["inputs"][0]["data"] = list(range(16))
    r = _post(pier, url, body)
    assert r.status_code == 400 and "But set 'data' 'shared_memory_region'" in r.json()["error"], r.text
    r = _post(pier, url, _identity_body(ok_in))  # and the same region still serves
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == list(range(16)), r.text
    c = grpcclient.InferenceServerClient(pier.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_shared_memory("nope", 64)
    with pytest.raises(InferenceServerException) as err:
        c.infer("identity_fp32", [inp])
    assert err.value.status() == "StatusCode.NOT_FOUND" and "Unable to find shared memory region" in str(err.value)


def test_a_region_shrunk_after_registration_is_refused_not_fatal(pier, regions):
    """Reading a mapping past the end of its file kills a process with SIGBUS: the server checks
    the file's size on every use instead."""
    _, key = regions.make(4096, register_as="shrinks")
    body = _identity_body({"shared_memory_region": "shrinks", "shared_memory_byte_size": 64,
                           "shared_memory_offset": 1024})
    assert _post(pier, "/v2/models/identity_fp32/infer", body).status_code == 200
    os.truncate(Path("/dev/shm") / key.lstrip("/"), 16)
    r = _post(pier, "/v2/models/identity_fp32/infer", body)
    assert r.status_code == 400 and "smaller than when it was registered" in r.json()["error"], r.text
    assert pier.proc.poll() is None
    assert requests.get(f"{pier.base()}/v2/health/ready", timeout=10).status_code == 200


@pytest.mark.skipif(not PA.exists(), reason=f"perf_analyzer not installed at {PA} (make perf-analyzer)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_system_shared_memory(pier, protocol):
    url = pier.http_url if protocol == "http" else pier.grpc_url
    cmd = [str(PA), "-m", "identity_fp32", "-i", protocol, "-u", url, "--shape", "INPUT0:16",
           "--shared-memory", "system", "--output-shared-memory-size", "1024",
           "--concurrency-range", "2", "-p", "500", "-s", "100", "-r", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Throughput:" in out and "error" not in out.lower(), out
    assert "Unable to unregister" not in out, out  # its cleanup also unregisters CUDA regions
    status = httpclient.InferenceServerClient(pier.http_url).get_system_shared_memory_status()
    assert [r for r in status if "pier_test" not in r["key"]] == []  # perf_analyzer unregistered its regions
