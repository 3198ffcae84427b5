"""A frontend process decides "serve here or relay" before it decodes anything
(server/frontends/workers/worker.py): its HTTP app in this process, its RemotePlane on a real
channel whose other end answers as the server would, the relay a recorder. The v2 infer path is
served here (the request crosses the channel decoded); a raw binary or compressed body is relayed
from its headers alone, unread; a request that puts a tensor in shared memory is relayed after its
JSON header is read, without a tensor decoded; every other path is relayed whole, past the guards
(the server applies them)."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pier.contract.types import InferenceResponse, Tensor
from pier.frontends.grpc import codec as grpc_codec
from pier.frontends.http import codec as http_codec
from pier.frontends.workers import messages as fm
from pier.frontends.workers.channel import Channel
from pier.frontends.workers.worker import RemotePlane, build_http_app
from pier.ipc import channel as wire
from pier.protocol import grpc_service_pb2 as pb
from pier.settings import Settings


class _Relay:
    """Stands in for HttpProxy (relaying is not what this test is about): records what it got."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes | None]] = []

    async def __call__(self, request: web.Request, body: bytes | None = None) -> web.StreamResponse:
        self.got.append((request.path, body))
        return web.json_response({"relayed": True})


class _Server:
    """The server's end of the channel: answers each Infer with its input as OUTPUT0."""

    def __init__(self, sock: Any) -> None:
        self.seen: list[fm.FromFrontend] = []
        self.channel = Channel(sock, self._message, lambda: None, fm.FROM_FRONTEND)

    def _message(self, message: fm.FromFrontend, mapping: wire.Source) -> None:
        self.seen.append(message)
        if isinstance(message, fm.Infer):
            x = wire.request_in(message.request, mapping).inputs[0]
            packer = wire.Packer()
            response = InferenceResponse(message.request.model, "1", [Tensor("OUTPUT0", x.datatype, x.shape, x.data)])
            self.channel.send(fm.Reply(message.rid, wire.response_out(response, packer)), packer)


INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


def test_what_is_served_here_and_what_is_relayed_is_decided_up_front() -> None:
    async def main() -> None:
        ours, theirs = wire.channel_pair()
        plane = RemotePlane()
        plane.channel = Channel(ours, plane.answer, plane.fail_all, fm.TO_FRONTEND, plane.unreadable)
        server = _Server(theirs)
        relay = _Relay()
        settings = Settings((Path("."),), api_keys=frozenset({"k"}))  # the guards are on for what is served here
        client = TestClient(TestServer(build_http_app(plane, settings, relay)))  # type: ignore[arg-type]
        await client.start_server()
        key = {"Authorization": "Bearer k"}
        try:
            r = await client.post("/v2/models/m/infer", json=INFER, headers=key)  # served here
            assert r.status == 200 and (await r.json())["outputs"][0]["data"] == [1.0, 2.0]
            assert [type(m) for m in server.seen] == [fm.Infer] and relay.got == []

            r = await client.post("/v2/models/m/infer", json=INFER)  # served here: the guards apply
            assert r.status == 401 and len(server.seen) == 1

            raw = np.ones(4, np.float32).tobytes()
            r = await client.post("/v2/models/m/infer", data=raw, headers={http_codec.HEADER_LENGTH: "0"})
            assert (await r.json()) == {"relayed": True} and relay.got[-1] == ("/v2/models/m/infer", None)

            packed = gzip.compress(json.dumps(INFER).encode())
            r = await client.post("/v2/models/m/versions/2/infer", data=packed, headers={"Content-Encoding": "gzip"})
            assert (await r.json()) == {"relayed": True} and relay.got[-1] == ("/v2/models/m/versions/2/infer", None)

            in_shm = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32",
                                  "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]}
            body = json.dumps(in_shm).encode()
            r = await client.post("/v2/models/m/infer", data=body, headers=key)
            assert (await r.json()) == {"relayed": True} and relay.got[-1] == ("/v2/models/m/infer", body)

            r = await client.get("/v2/models/m")  # no key: the frontend does not refuse it, the server decides
            assert (await r.json()) == {"relayed": True} and relay.got[-1] == ("/v2/models/m", None)
            assert len(server.seen) == 1  # nothing but the first request crossed the channel
        finally:
            await client.close()
            plane.channel.close()
            server.channel.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_checks_read_only_the_request_line_headers_and_inference_header() -> None:
    assert http_codec.is_raw_binary({http_codec.HEADER_LENGTH: "0"})
    assert not http_codec.is_raw_binary({http_codec.HEADER_LENGTH: "12"})
    assert not http_codec.is_raw_binary({http_codec.HEADER_LENGTH: "x"}) and not http_codec.is_raw_binary({})
    out_in_shm = {"inputs": [], "outputs": [{"name": "Y", "parameters": {"shared_memory_region": 5}}]}
    assert http_codec.names_shared_memory(out_in_shm)  # malformed or not: the server says what is wrong
    assert not http_codec.names_shared_memory(INFER)
    assert not http_codec.names_shared_memory({"inputs": "junk"}) and not http_codec.names_shared_memory([1])
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="X", datatype="FP32", shape=[1])
    assert not grpc_codec.names_shared_memory(req)
    req.outputs.add(name="Y").parameters["shared_memory_region"].string_param = "r"
    assert grpc_codec.names_shared_memory(req)
