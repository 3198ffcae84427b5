"""The identity echo of python-limit's bare_http.py on a raw asyncio protocol with httptools (the
HTTP parser uvicorn uses) under uvloop: no aiohttp web layer (no Request, router, middleware or
Response objects), one write per answer. Binary tensors and JSON, keep-alive, what perf_analyzer
asks before it measures. Usage: python raw_http.py PORT"""

from __future__ import annotations

import asyncio
import json
import sys

import httptools
import uvloop

NAME = "identity_fp32"
_TENSOR = {"datatype": "FP32", "shape": [-1, -1]}
META = json.dumps({"name": NAME, "versions": ["1"], "platform": "bare", "inputs": [{"name": "INPUT0", **_TENSOR}],
                   "outputs": [{"name": "OUTPUT0", **_TENSOR}]}).encode()
CONFIG = json.dumps({"name": NAME, "platform": "bare", "max_batch_size": 64,
                     "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
                     "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}).encode()
STATS = json.dumps({"model_stats": [{"name": NAME, "version": "1", "last_inference": 0, "inference_count": 0,
                                     "execution_count": 0, "inference_stats": {}, "batch_stats": []}]}).encode()
HEADER_LENGTH = b"inference-header-content-length"


def _answer(body: bytes, content_type: bytes = b"application/json", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (content_type, len(body), extra)
            + body)


def infer(headers: dict[bytes, bytes], body: bytes) -> bytes:
    n = headers.get(HEADER_LENGTH)
    if n is None:  # JSON tensors
        i = json.loads(body)["inputs"][0]
        return _answer(json.dumps({"model_name": NAME, "model_version": "1", "outputs": [
            {"name": "OUTPUT0", "datatype": i["datatype"], "shape": i["shape"], "data": i["data"]}]}).encode())
    size = int(n)
    i, data = json.loads(body[:size])["inputs"][0], body[size:]
    header = json.dumps({"model_name": NAME, "model_version": "1", "outputs": [
        {"name": "OUTPUT0", "datatype": i["datatype"], "shape": i["shape"],
         "parameters": {"binary_data_size": len(data)}}]}).encode()
    return _answer(header + data, b"application/octet-stream", b"Inference-Header-Content-Length: %d\r\n" % len(header))


class Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url, self.headers, self.body = b"", {}, []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, headers, body = self.url, self.headers, b"".join(self.body)
        self.url, self.headers, self.body = b"", {}, []
        if url.endswith(b"/infer"):
            out = infer(headers, body)
        elif url.endswith(b"/stats"):
            out = _answer(STATS)
        elif url.endswith(b"/config"):
            out = _answer(CONFIG)
        elif url.startswith(b"/v2/models/") and not url.endswith(b"/ready"):
            out = _answer(META)
        else:  # health, readiness, server metadata
            out = _answer(b"{}")
        self.transport.write(out)  # type: ignore[attr-defined]
        if not self.parser.should_keep_alive():
            self.transport.close()


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(main(int(sys.argv[1])))
