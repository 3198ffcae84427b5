"""SystemSharedMemory on real /dev/shm files, and the gRPC codec's pairing of raw_input_contents
with the inputs that are not in shared memory."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from pier.contract.errors import ErrorCode, PierError
from pier.dataplane.shared_memory import Placement, SystemSharedMemory
from pier.frontends.grpc import codec
from pier.protocol import grpc_service_pb2 as pb


@pytest.fixture
def region():
    key = f"/pier_unit_{uuid.uuid4().hex[:12]}"
    path = "/dev/shm" + key
    with open(path, "wb") as f:
        f.write(np.arange(32, dtype=np.float32).tobytes())
    manager = SystemSharedMemory()
    yield manager, key, path
    manager.close()
    os.unlink(path)


def test_read_write_within_the_registered_window(region):
    manager, key, path = region
    manager.register("r", key, 16, 64)  # bytes 16..80 of the file: floats 4..19
    data = np.frombuffer(manager.read(Placement("r", 16, 8)), dtype=np.float32)
    assert data.tolist() == [6.0, 7.0, 8.0, 9.0]
    manager.write(Placement("r", 8, 0), np.array([-1, -2], dtype=np.float32).tobytes(), "OUT")
    with open(path, "rb") as f:
        assert np.frombuffer(f.read(), dtype=np.float32)[4:7].tolist() == [-1.0, -2.0, 6.0]
    with pytest.raises(PierError, match="Invalid offset \\+ byte size"):
        manager.read(Placement("r", 16, 56))  # past the window, though inside the file
    with pytest.raises(PierError, match="should be at least 12 bytes"):
        manager.write(Placement("r", 8, 0), b"x" * 12, "OUT")
    assert manager.status() == [{"name": "r", "key": key, "offset": 16, "byte_size": 64}]
    manager.unregister("r")
    with pytest.raises(PierError) as err:
        manager.read(Placement("r", 4, 0))
    assert err.value.code == ErrorCode.NOT_FOUND


def test_one_region_per_key_and_per_name(region):
    manager, key, _ = region
    manager.register("a", key, 0, 16)
    with pytest.raises(PierError) as err:
        manager.register("a", key, 0, 16)
    assert err.value.code == ErrorCode.ALREADY_EXISTS
    with pytest.raises(PierError, match="Invalid shared memory region"):  # as Triton 2.51
        manager.register("b", key, 16, 16)


def _request(raw_for: list[str], shm_for: list[str]) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m")
    for name in ("A", "B"):
        t = req.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        if name in shm_for:
            t.parameters["shared_memory_region"].string_param = "r"
            t.parameters["shared_memory_byte_size"].int64_param = 16
    for name in raw_for:
        req.raw_input_contents.append(np.full(4, 7 if name == "B" else 1, dtype=np.float32).tobytes())
    return req


def test_grpc_raw_contents_pair_with_the_inputs_not_in_shared_memory(region):
    manager, key, _ = region
    manager.register("r", key, 0, 128)
    decoded = codec.decode_request(_request(["B"], ["A"]), manager)  # raw[0] is B's
    assert decoded.inputs[0].data.ravel().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert decoded.inputs[1].data.ravel().tolist() == [7.0] * 4
    assert "shared_memory_region" not in decoded.inputs[0].parameters
    with pytest.raises(PierError, match="raw_input_contents has 2 entries but the request has 1 inputs"):
        codec.decode_request(_request(["A", "B"], ["A"]), manager)
    with pytest.raises(PierError, match="unable to find data for input tensor 'B'"):
        codec.decode_request(_request(["B"], []), manager)
    with pytest.raises(PierError, match="not supported"):
        codec.decode_request(_request(["B"], ["A"]), None)


def test_a_region_in_use_cannot_be_unregistered(region):
    manager, key, _ = region
    manager.register("busy", key, 0, 64)
    for name in ("free", "also_busy"):  # one region per key (as Triton): two more files
        path = f"/dev/shm/pier_unit_{name}_{uuid.uuid4().hex[:8]}"
        with open(path, "wb") as f:
            f.write(bytes(64))
        manager.register(name, path.removeprefix("/dev/shm"), 0, 64)
        os.unlink(path)  # the registration holds it open
    manager.use(("busy", "busy", "also_busy"))  # two requests in flight name it, one the other
    with pytest.raises(PierError, match="Cannot unregister shared memory region 'busy', it is currently in use"):
        manager.unregister("busy")
    with pytest.raises(PierError) as err:  # unregister-all: the free region goes, Triton's words name the others
        manager.unregister()
    assert ("Failed to unregister the following system shared memory regions: also_busy ,busy ,"
            in err.value.message), err.value.message
    assert [r["name"] for r in manager.status()] == ["busy", "also_busy"]
    manager.done(("also_busy",))
    manager.unregister("also_busy")
    manager.done(("busy",))
    with pytest.raises(PierError, match="currently in use"):
        manager.unregister("busy")
    manager.done(("busy",))
    manager.unregister("busy")
    assert manager.status() == []
