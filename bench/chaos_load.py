"""The fault campaign's load (bench/chaos.py): workloads that check every answer, clients that
misbehave, and the tally.

Every request ends in exactly one outcome: `ok` (the right answer: every output checked, a
stream's responses all there and in order), `wrong` (an answer, not the right one), `error` (the
server or the transport said why; the message is sorted by the fault it names, ERROR_KINDS, or
"other"), `hung` (no answer within REQUEST_TIMEOUT_S: lost), or `left` (the client went away on
purpose, mid-stream). Each workload is one thread, one request at a time (closed loop)."""

from __future__ import annotations

import json
import queue
import re
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

REQUEST_TIMEOUT_S = 60.0  # no answer by then: lost
PAUSE_S = 0.02  # between two requests of one workload

# An error message -> the fault it names. The first pattern that matches wins.
ERROR_KINDS = [
    ("LLM engine core killed", r"LLM engine"),
    ("stub killed", r"killed by signal|stub process|Stub process|is not healthy|stub .*(died|exited)"),
    ("model unloaded / reloading / not loaded", r"not (found|available|ready)|unknown model|unavailable|"
                                                r"no longer available|is not ready|UNAVAILABLE: .*model|"
                                                r"has no available|unloading|failed to load|Server is stopping|"
                                                r"was unloaded"),
    ("connection dropped (its frontend process was killed)",
     r"[Cc]onnection (reset|aborted|refused|closed)|Socket closed|RemoteDisconnected|EOF|[Bb]roken pipe|"
     r"failed to connect|Connection lost|Server disconnected|peer closed|incomplete chunked read|"
     r"closed connection without response|stream removed|ConnectionError|RemoteProtocolError"),
    ("cancelled", r"[Cc]ancel"),
]


def error_kind(message: str) -> str:
    for kind, pattern in ERROR_KINDS:
        if re.search(pattern, message):
            return kind
    return "other"


@dataclass
class Tally:
    """Every outcome of every workload, thread-safe; errors by kind, with an example of each."""

    outcomes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    examples: dict[tuple[str, str], str] = field(default_factory=dict)
    events: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, workload, outcome, kind)
    t0: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, workload: str, outcome: str, detail: str = "") -> None:
        kind = error_kind(detail) if outcome == "error" else ""
        key = outcome if not kind else f"error: {kind}"
        with self._lock:
            self.outcomes[workload][key] += 1
            if outcome != "ok" and (workload, key) not in self.examples:
                self.examples[(workload, key)] = detail[:300]
            if outcome != "ok":
                self.events.append((time.monotonic() - self.t0, workload, outcome, kind))


class Workload:
    """One thread sending one kind of request in a closed loop until stopped; `once()` sends one
    request (or one sequence) and records its outcome."""

    name = ""

    def __init__(self, target: Any, tally: Tally) -> None:
        self.target = target
        self.tally = tally
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.rng = np.random.default_rng(abs(hash(self.name)) % (1 << 32))

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.once()
            except Exception as exc:  # a bug of the load generator itself: record it loudly
                self.tally.add(self.name, "error", f"load generator: {type(exc).__name__}: {exc}")
            self.stop.wait(PAUSE_S)

    def once(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Close the client's connections (before a resource sample: the server's descriptors
        then count its own, not the load's)."""
        client, self.client = getattr(self, "client", None), None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def record(self, outcome: str, detail: str = "") -> None:
        self.tally.add(self.name, outcome, detail)

    def failed(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        hung = re.search(r"[Tt]imed? ?out|DEADLINE_EXCEEDED|Deadline Exceeded|timeout", text)
        self.record("hung" if hung else "error", text)


def _pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    a = rng.integers(-1000, 1000, size=(1, 16), dtype=np.int32)
    b = rng.integers(-1000, 1000, size=(1, 16), dtype=np.int32)
    return a, b


def _inputs(mod: Any, arrays: dict[str, np.ndarray]) -> list:
    from tritonclient.utils import np_to_triton_dtype

    out = []
    for name, array in arrays.items():
        inp = mod.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        inp.set_data_from_numpy(array)
        out.append(inp)
    return out


class HttpAddSub(Workload):
    """v2 infer over HTTP: `model` (addsub_py, or Pier's ONNX `simple`), answers checked."""

    def __init__(self, target: Any, tally: Tally, model: str, outputs: tuple[str, str] = ("OUTPUT0", "OUTPUT1"),
                 factor: int = 1) -> None:
        self.name = f"HTTP v2 {model}"
        super().__init__(target, tally)
        self.model, self.outputs, self.factor = model, outputs, factor
        self.client: Any = None
        self.owner = 0  # the thread the client was made on (a gevent client stays on its thread)

    def close(self) -> None:
        """A gevent client closes on the thread that made it; one made elsewhere is dropped (the
        garbage collector closes its sockets)."""
        if self.owner == threading.get_ident():
            super().close()
        self.client = None

    def _expected(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.factor == 2:  # the ensemble: addsub twice
            return 2 * a, 2 * b
        return a + b, a - b

    def once(self) -> None:
        import tritonclient.http as httpclient

        if self.client is None or self.owner != threading.get_ident():
            self.close()
            self.client = httpclient.InferenceServerClient(self.target.http, connection_timeout=REQUEST_TIMEOUT_S,
                                                           network_timeout=REQUEST_TIMEOUT_S)
            self.owner = threading.get_ident()
        a, b = _pair(self.rng)
        try:
            result = self.client.infer(self.model, _inputs(httpclient, {"INPUT0": a, "INPUT1": b}))
        except Exception as exc:
            self.failed(exc)
            self.close()  # a broken connection: a new client
            return
        want = self._expected(a, b)
        got = (result.as_numpy(self.outputs[0]), result.as_numpy(self.outputs[1]))
        ok = all(g is not None and np.array_equal(g, w) for g, w in zip(got, want, strict=True))
        self.record("ok" if ok else "wrong", f"got {got}, expected {want}")


class GrpcAddSub(Workload):
    """v2 infer over gRPC (unary): addsub_py, answers checked."""

    def __init__(self, target: Any, tally: Tally, model: str = "addsub_py") -> None:
        self.name = f"gRPC v2 {model}"
        super().__init__(target, tally)
        self.model = model
        self.client: Any = None

    def once(self) -> None:
        import tritonclient.grpc as grpcclient

        if self.client is None:
            self.client = grpcclient.InferenceServerClient(self.target.grpc)
        a, b = _pair(self.rng)
        try:
            result = self.client.infer(self.model, _inputs(grpcclient, {"INPUT0": a, "INPUT1": b}),
                                       client_timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:
            self.failed(exc)
            return
        ok = np.array_equal(result.as_numpy("OUTPUT0"), a + b) and np.array_equal(result.as_numpy("OUTPUT1"), a - b)
        self.record("ok" if ok else "wrong", f"got {result.as_numpy('OUTPUT0')}")


class GrpcDecoupledStream(Workload):
    """A gRPC stream to count_py: each request's N responses, in order, then its (empty) final one."""

    name = "gRPC stream count_py (decoupled)"

    def __init__(self, target: Any, tally: Tally) -> None:
        super().__init__(target, tally)
        self.client: Any = None
        self.answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.n = 0

    def _open(self) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(self.target.grpc)
        self.answers = queue.Queue()
        answers = self.answers
        self.client.start_stream(lambda result, error: answers.put((result, error)))

    def close(self) -> None:
        self._close()

    def _close(self) -> None:
        if self.client is not None:
            try:
                self.client.stop_stream(cancel_requests=True)
                self.client.close()
            except Exception:
                pass
        self.client = None

    def once(self) -> None:
        import tritonclient.grpc as grpcclient

        if self.client is None:
            self._open()
        self.n += 1
        n = int(self.rng.integers(3, 12))
        rid = f"r{self.n}"
        self.client.async_stream_infer("count_py", _inputs(grpcclient, {"N": np.array([n], np.int32),
                                                                        "DELAY_MS": np.array([5], np.int32)}),
                                       request_id=rid, enable_empty_final_response=True)
        got: list[int] = []
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while True:
            try:
                result, error = self.answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.record("hung", f"{rid}: {len(got)} of {n} responses, no final one")
                self._close()
                return
            if error is not None:
                self.record("error", f"{error} (after {len(got)} of {n} responses)")
                self._close()  # a stream that failed as a whole ends; an in-band error leaves it open, but start anew
                return
            response = result.get_response()
            if response.id != rid:
                self.record("wrong", f"a response of {response.id} while waiting for {rid}")
                self._close()
                return
            final = response.parameters.get("triton_final_response")
            out = result.as_numpy("I")
            if out is not None:
                got.append(int(out[0]))
            if final is not None and final.bool_param:
                break
        self.record("ok" if got == list(range(n)) else "wrong", f"responses {got}, expected 0..{n - 1}")


class GrpcSequence(Workload):
    """Sequences of four requests to seq_py over gRPC: the running sum, plus the correlation ID
    on the last one. A sequence whose request fails is abandoned (it idles out)."""

    name = "gRPC sequences seq_py"

    def __init__(self, target: Any, tally: Tally) -> None:
        super().__init__(target, tally)
        self.client: Any = None
        self.sequence = 1000

    def once(self) -> None:
        import tritonclient.grpc as grpcclient

        if self.client is None:
            self.client = grpcclient.InferenceServerClient(self.target.grpc)
        self.sequence += 1
        sid = self.sequence
        total = 0
        for step in range(4):
            value = int(self.rng.integers(1, 100))
            total += value
            last = step == 3
            try:
                inputs = _inputs(grpcclient, {"INPUT": np.array([[value]], np.int32)})
                result = self.client.infer("seq_py", inputs, sequence_id=sid, sequence_start=step == 0,
                                           sequence_end=last, client_timeout=REQUEST_TIMEOUT_S)
            except Exception as exc:
                self.failed(exc)
                return
            want = total + (self.sequence if last else 0)
            got = int(result.as_numpy("OUTPUT")[0][0])
            self.record("ok" if got == want else "wrong", f"sequence {sid} step {step}: {got}, expected {want}")
            if got != want:
                return


class OpenAIStream(Workload):
    """The OpenAI API, streamed completions on the tiny LLM (greedy): the text must equal the
    reference the same prompt gave before any fault, and end with finish_reason "length"."""

    name = "OpenAI completions stream tiny_llama"
    PROMPTS = ["The quick brown fox", "Paged attention keeps", "Continuous batching admits", "Prefix caching"]
    TOKENS = 48

    def __init__(self, target: Any, tally: Tally) -> None:
        super().__init__(target, tally)
        self.reference: dict[str, str] = {}
        self.turn = 0

    def complete(self, prompt: str) -> tuple[str, str | None]:
        import openai

        text, finish = "", None
        with openai.OpenAI(base_url=f"http://{self.target.http}/v1", api_key="none", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S) as client:
            for chunk in client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=self.TOKENS,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
        return text, finish

    def warm(self) -> None:
        for prompt in self.PROMPTS:
            self.reference[prompt] = self.complete(prompt)[0]

    def once(self) -> None:
        prompt = self.PROMPTS[self.turn % len(self.PROMPTS)]
        self.turn += 1
        try:
            text, finish = self.complete(prompt)
        except Exception as exc:
            self.failed(exc)
            return
        if finish != "length":
            self.record("wrong", f"finish_reason {finish!r} after {text!r}")
        else:
            self.record("ok" if text == self.reference[prompt] else "wrong", f"{text!r} != {self.reference[prompt]!r}")


def _http_post(address: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw HTTP/1.1 POST on a new connection; the caller reads (or does not read) the answer."""
    host, port = address.rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


class Disconnectors(Workload):
    """Clients that go away mid-stream, one every 2 s: a gRPC stream cancelled after its second
    response, an HTTP generate_stream closed after its first event, and (Pier) an OpenAI stream
    closed after its first chunk. `left` when the stream had started; errors as they come."""

    name = "clients that disconnect mid-stream"

    def __init__(self, target: Any, tally: Tally, openai: bool) -> None:
        super().__init__(target, tally)
        self.kinds: list[Callable[[], None]] = [self._grpc, self._generate_stream] + ([self._openai] if openai else [])
        self.turn = 0

    def once(self) -> None:
        self.kinds[self.turn % len(self.kinds)]()
        self.turn += 1
        self.stop.wait(2.0)

    def _grpc(self) -> None:
        import tritonclient.grpc as grpcclient

        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client = grpcclient.InferenceServerClient(self.target.grpc)
        try:
            client.start_stream(lambda result, error: answers.put((result, error)))
            client.async_stream_infer("count_py", _inputs(grpcclient, {"N": np.array([500], np.int32),
                                                                       "DELAY_MS": np.array([10], np.int32)}))
            for _ in range(2):
                result, error = answers.get(timeout=REQUEST_TIMEOUT_S)
                if error is not None:
                    self.record("error", str(error))
                    return
            self.record("left")
        except queue.Empty:
            self.record("hung", "no response on the stream")
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()

    def _raw_stream(self, path: str, body: dict[str, Any]) -> None:
        """POST on a new connection; once the answer's headers and first event are in, go away."""
        try:
            sock = _http_post(self.target.http, path, body)
        except OSError as exc:
            self.record("error", f"{type(exc).__name__}: {exc}")
            return
        try:
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError(f"the server closed the connection: {got[:200]!r}")
                got += chunk
            head, rest = got.split(b"\r\n\r\n", 1)
            status = head.split(b"\r\n", 1)[0].decode(errors="replace")
            if " 200 " not in status:  # an error answer: its whole body (it says why)
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                while length and len(rest) < int(length.group(1)):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    rest += chunk
                self.record("error", f"{status}: {rest[:300].decode(errors='replace')}")
                return
            while b"data: " not in rest:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError(f"the stream ended before its first event: {rest[:200]!r}")
                rest += chunk
            self.record("left")
        except OSError as exc:
            self.record("hung" if isinstance(exc, TimeoutError) else "error", f"{type(exc).__name__}: {exc}")
        finally:
            sock.close()

    def _generate_stream(self) -> None:
        self._raw_stream("/v2/models/count_py/generate_stream", {"N": 500, "DELAY_MS": 10})

    def _openai(self) -> None:
        self._raw_stream("/v1/completions", {"model": "tiny_llama", "prompt": "a long story", "max_tokens": 400,
                                             "temperature": 0, "stream": True, "ignore_eos": True})


class SlowReaders:
    """Clients that never read: generate_stream of count_py asking for `responses` as fast as the
    model can send them, and (Pier) an OpenAI stream of 1500 tokens; opened at `open()`, held,
    closed at `close()`. The rest of the load must go on meanwhile."""

    def __init__(self, target: Any, openai: bool, responses: int = 20000) -> None:
        self.target = target
        self.openai = openai
        self.responses = responses
        self.socks: list[socket.socket] = []
        self.opened: list[str] = []

    def open(self) -> None:
        asks: list[tuple[str, dict[str, Any]]] = [("/v2/models/count_py/generate_stream",
                                                   {"N": self.responses, "DELAY_MS": 0})]
        if self.openai:
            asks.append(("/v1/completions", {"model": "tiny_llama", "prompt": "never read", "max_tokens": 1500,
                                             "temperature": 0, "stream": True, "ignore_eos": True}))
        for path, body in asks:
            try:
                sock = _http_post(self.target.http, path, body)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel buffers little for us
                self.socks.append(sock)
                self.opened.append(path)
            except OSError as exc:
                self.opened.append(f"{path}: {exc}")

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks.clear()
