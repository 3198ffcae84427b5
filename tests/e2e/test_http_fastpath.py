"""The v2 infer route served below aiohttp (pier/frontends/http/fastpath.py), on raw sockets: a
plain infer is framed and answered by the fast protocol, anything else hands the connection to
aiohttp at that request's first byte. Every answer comes back in order on one connection, and a
request answers the same (status, body, content type, request id) whichever of the two serves it:
a request with a header given twice is always aiohttp's."""

from __future__ import annotations

import gzip
import json
import socket
import zlib

import pytest

from tests.conftest import PierProcess

pytestmark = pytest.mark.frontends  # with frontend processes the same requests go through them

INFER = "/v2/models/identity_fp32/infer"


def _body(values: list[float]) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, len(values)],
                                   "data": values}]}).encode()


def _request(path: str, body: bytes | None = None, headers: list[tuple[str, str]] = (),  # type: ignore[assignment]
             method: str = "POST", version: str = "HTTP/1.1") -> bytes:
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers)]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


class _Reader:
    """HTTP/1.1 answers read one after another from one socket (Content-Length or chunked)."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = sock.makefile("rb")

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        status = self.file.readline()
        assert status.startswith(b"HTTP/1."), status
        headers: dict[str, str] = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while (size := int(self.file.readline().strip(), 16)) > 0:
                body += self.file.read(size)
                self.file.readline()
            self.file.readline()
        else:
            body = self.file.read(int(headers.get("content-length", "0")))
        return int(status.split()[1]), headers, body


def _connect(server: PierProcess) -> tuple[socket.socket, _Reader]:
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    return sock, _Reader(sock)


def _outputs(body: bytes) -> list[float]:
    return json.loads(body)["outputs"][0]["data"]


def test_one_connection_mixes_both_and_keeps_the_order(pier: PierProcess) -> None:
    sock, reader = _connect(pier)
    with sock:
        sock.sendall(_request(INFER, _body([1, 2]), [("X-Request-Id", "first")]))
        status, headers, body = reader.answer()
        assert (status, headers["x-request-id"], _outputs(body)) == (200, "first", [1, 2])
        sock.sendall(_request(INFER, _body([3, 4])))
        status, headers, body = reader.answer()
        assert status == 200 and _outputs(body) == [3, 4] and len(headers["x-request-id"]) == 32
        sock.sendall(_request("/v2/models/identity_fp32/config", method="GET"))  # aiohttp's from here on
        status, _, body = reader.answer()
        assert status == 200 and json.loads(body)["name"] == "identity_fp32"
        sock.sendall(_request(INFER, _body([5, 6])))
        status, _, body = reader.answer()
        assert status == 200 and _outputs(body) == [5, 6]
    sock, reader = _connect(pier)
    with sock:  # pipelined: four requests in one write, aiohttp's from the third on, answered in order
        sock.sendall(_request(INFER, _body([7])) + _request("/v2/models/nope/infer", _body([8]))
                     + _request("/v2/health/ready", method="GET") + _request(INFER, _body([9])))
        answers = [reader.answer() for _ in range(4)]
    assert [a[0] for a in answers] == [200, 404, 200, 200], answers
    assert _outputs(answers[0][2]) == [7] and _outputs(answers[3][2]) == [9]
    assert "Request for unknown model: 'nope' is not found" in json.loads(answers[1][2])["error"]


def test_a_request_handed_over_after_its_body_was_read_keeps_the_order(pier: PierProcess) -> None:
    """A raw binary body, pipelined between two plain infers: one process serves it on the fast
    path; a frontend process decides only once it has read the body that the server must decode it
    (fastpath.HandOver) and hands the connection to aiohttp with that request's bytes put back in
    front of the next one's, which aiohttp then serves."""
    sock, reader = _connect(pier)
    with sock:
        sock.sendall(_request(INFER, _body([1])) + _request(INFER, b"\0\0\x80\x3f", [
            ("Inference-Header-Content-Length", "0"), ("X-Request-Id", "raw")]) + _request(INFER, _body([3])))
        answers = [reader.answer() for _ in range(3)]
    assert [a[0] for a in answers] == [200, 200, 200], answers
    assert _outputs(answers[0][2]) == [1] and _outputs(answers[2][2]) == [3]
    assert answers[1][1]["x-request-id"] == "raw" and answers[1][2][-4:] == b"\0\0\x80\x3f", answers[1]


def test_pipelined_on_a_fresh_connection(pier: PierProcess) -> None:
    sock, reader = _connect(pier)
    with sock:
        sock.sendall(b"".join(_request(INFER, _body([float(i)])) for i in range(5)))
        assert [_outputs(reader.answer()[2]) for _ in range(5)] == [[float(i)] for i in range(5)]


_HEADER = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2],
                                  "parameters": {"binary_data_size": 8}}]}).encode()
CASES = {
    "json": (_body([1.5, -2]), []),
    "binary output": (json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [1]}],
                                  "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode(), []),
    "binary input": (_HEADER + b"\0" * 8, [("Inference-Header-Content-Length", str(len(_HEADER)))]),
    "raw binary": (b"\0\0\x80\x3f", [("Inference-Header-Content-Length", "0")]),
    "bad json": (b"{bad", []),
    "bad header length": (_body([1]), [("Inference-Header-Content-Length", "x")]),
    "wrong datatype": (_body([1]).replace(b"FP32", b"INT8"), []),
    "unknown version": (_body([1]), []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_paths_answer_alike(pier: PierProcess, case: str) -> None:
    body, headers = CASES[case]
    path = "/v2/models/identity_fp32/versions/7/infer" if case == "unknown version" else INFER
    answers = []
    for extra in ([], [("X-Twice", "1"), ("X-Twice", "2")]):  # a header given twice: aiohttp's
        sock, reader = _connect(pier)
        with sock:
            sock.sendall(_request(path, body, [*headers, *extra, ("X-Request-Id", case)]))
            answers.append(reader.answer())
    fast, slow = answers
    assert fast[0] == slow[0] and fast[2] == slow[2], (fast, slow)
    for key in ("content-type", "inference-header-content-length", "x-request-id", "retry-after"):
        assert fast[1].get(key) == slow[1].get(key), (key, fast[1], slow[1])
    assert fast[1]["x-request-id"] == case


def test_chunked_compressed_and_old_requests_go_to_aiohttp(pier: PierProcess) -> None:
    body = _body([1, 2, 3])
    chunked = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               f"{len(body):x}\r\n").encode() + body + b"\r\n0\r\n\r\n"
    packed = gzip.compress(body)
    for request in (chunked,
                    _request(INFER, packed, [("Content-Encoding", "gzip")]),
                    _request(INFER, body, [("Expect", "100-continue")]),
                    _request(INFER, body, version="HTTP/1.0")):
        sock, reader = _connect(pier)
        with sock:
            sock.sendall(request)
            status, headers, answer = reader.answer()
            if status == 100:
                status, headers, answer = reader.answer()
        assert status == 200 and _outputs(answer) == [1, 2, 3], (request[:80], status, answer)
    sock, reader = _connect(pier)  # two lengths: aiohttp's 400, not a smuggled second request
    with sock:
        sock.sendall(_request(INFER, body, [("Content-Length", str(len(body)))]))
        assert reader.answer()[0] == 400


def test_connection_close_and_compressed_answers(pier: PierProcess) -> None:
    values = [float(i) for i in range(400)]  # an answer over 1 KiB: compressed when the client accepts it
    for accept, decode in (("gzip", gzip.decompress), ("deflate", zlib.decompress), ("gzip, deflate", zlib.decompress)):
        sock, reader = _connect(pier)
        with sock:
            sock.sendall(_request(INFER, _body(values), [("Accept-Encoding", accept), ("Connection", "close")]))
            status, headers, body = reader.answer()
            assert sock.recv(1) == b""  # closed after the answer
        assert status == 200 and headers["connection"] == "close", headers
        assert headers["content-encoding"] == accept.split(", ")[-1] and _outputs(decode(body)) == values
