"""One routing decision per request. Two versions of one model take traffic 50/50 while their
configurations differ (version 1 takes FP32 [4], version 2 INT32 [4]: what a configuration change
rolling through looks like). A request that must be decoded against the model's signature (raw
binary, generate, a gRPC stream's request) is decoded, validated and run by the version it
drew: every answer succeeds, names that version, and carries its datatype. Resolving the model
again after decoding would draw again: about half the requests would run on the other version.

The HTTP app and gRPC server are the real ones, in this process, over real ONNX models; the
routing snapshot is published by hand, as the life cycle would publish it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import numpy as np
import orjson
from aiohttp import web

from pier.contract.backend import ServerServices
from pier.control.manager import RepositoryManager
from pier.control.plane import ControlPlane
from pier.dataplane.plane import DataPlane
from pier.frontends.grpc.servicer import start_grpc_server
from pier.frontends.http.app import build_app
from pier.lifecycle.lifecycle import ModelLifecycle
from pier.lifecycle.routing import Route, RoutingTable
from pier.protocol import grpc_service_pb2 as pb
from pier.protocol import grpc_service_pb2_grpc as pb_grpc
from pier.repository import disk
from scripts.build_example_models import identity_model, write_model
from tests.conftest import free_port

REQUESTS = 40
DATATYPES = {1: "FP32", 2: "INT32"}


def _config(datatype: str) -> str:
    return (f'name: "m"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
            f'input [ {{ name: "INPUT0" data_type: TYPE_{datatype} dims: [ 4 ] }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: TYPE_{datatype} dims: [ 4 ] }} ]\n')


async def _two_configs(tmp: Path, routes: RoutingTable, services: ServerServices) -> ModelLifecycle:
    """Versions 1 and 2 of 'm', each loaded with its own configuration, published 50/50."""
    lifecycle = ModelLifecycle(routes, services)
    loaded = {}
    for version, datatype in DATATYPES.items():
        path = write_model(tmp / f"repo{version}", "m", _config(datatype), identity_model(datatype, [4]),
                           version=version)
        on_disk = disk.read_model("m", path, None, "", False, set(), set())
        record = lifecycle.model(f"m{version}")
        assert await lifecycle.apply(record, on_disk, force=True) == ""
        loaded[version] = record.ready()[version]
    routes.publish(Route.build("m", frozenset(loaded), loaded, {1: 50.0, 2: 50.0}))
    return lifecycle


def _check(version: str, datatype: str) -> None:
    assert datatype == DATATYPES[int(version)], f"decoded as {datatype}, answered by version {version}"


def test_one_version_decodes_validates_and_runs_each_request(tmp_path: Path) -> None:
    async def main() -> dict[str, int]:
        routes = RoutingTable()
        plane = DataPlane(routes, strict_readiness=False)
        lifecycle = await _two_configs(tmp_path, routes, None)  # type: ignore[arg-type]
        control = ControlPlane(RepositoryManager(lifecycle, [], False), "explicit")
        runner = web.AppRunner(build_app(plane, control, 1 << 20))
        await runner.setup()
        http_port, grpc_port = free_port(), free_port()
        await web.TCPSite(runner, "127.0.0.1", http_port).start()
        grpc_server = await start_grpc_server(plane, control, f"127.0.0.1:{grpc_port}", 1 << 24, (), False)
        seen = {"1": 0, "2": 0}
        try:
            await asyncio.gather(*(_raw_binary(http_port, seen) for _ in range(REQUESTS)))
            await asyncio.gather(*(_generate(http_port, seen) for _ in range(REQUESTS)))
            await _grpc_stream(grpc_port, seen)
        finally:
            await grpc_server.stop(None)
            await runner.cleanup()
        return seen

    seen = asyncio.run(main())
    assert seen["1"] > 0 and seen["2"] > 0, seen  # both versions took traffic


async def _raw_binary(port: int, seen: dict[str, int]) -> None:
    import aiohttp

    body = np.arange(4, dtype=np.int32).tobytes()  # 16 bytes: four FP32 or four INT32 values
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v2/models/m/infer", data=body,
                                headers={"Inference-Header-Content-Length": "0"}) as r:
            payload = await r.read()
            assert r.status == 200, payload
            header = orjson.loads(payload[: int(r.headers["Inference-Header-Content-Length"])])
    _check(header["model_version"], header["outputs"][0]["datatype"])
    seen[header["model_version"]] += 1


async def _generate(port: int, seen: dict[str, int]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v2/models/m/generate",
                                data=json.dumps({"INPUT0": [1, 2, 3, 4]})) as r:
            doc = await r.json()
            assert r.status == 200, doc
    value = doc["OUTPUT0"][0]
    _check(doc["model_version"], "FP32" if isinstance(value, float) else "INT32")
    seen[doc["model_version"]] += 1


async def _grpc_stream(port: int, seen: dict[str, int]) -> None:
    def request(i: int) -> pb.ModelInferRequest:
        req = pb.ModelInferRequest(model_name="m", id=str(i))
        tensor = req.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
        tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
        return req

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answers = [a async for a in stub.ModelStreamInfer(iter([request(i) for i in range(REQUESTS)]))]
    for answer in answers:
        # an FP32 request drawn to the INT32 version is refused by that version, never run by the other
        if answer.error_message:
            assert "INT32" in answer.error_message and "FP32" in answer.error_message, answer.error_message
            continue
        version = answer.infer_response.model_version
        _check(version, answer.infer_response.outputs[0].datatype)
        seen[version] += 1
