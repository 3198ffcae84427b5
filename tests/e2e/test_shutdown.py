"""SIGTERM: the listeners close at once (a new connection is refused, as nginx, Go's Shutdown and
Envoy do; Triton resets new HTTP connections); a connection opened before is still served, each
HTTP answer with `Connection: close` (readiness 503 there), gRPC clients get GOAWAY (their calls
and streams in flight finish, the next call reconnects); requests in flight (queued ones
included), streams among them, finish; exit 0. The exit timeout: tests/e2e/test_exit_timeout.py."""

from __future__ import annotations

import itertools
import json
import signal
import threading
import time

import pytest
import requests

from tests.conftest import PierProcess, start_pier
from tests.model_builders import slow_model, write_sleep_models

HOLD_S = 4.0  # how long the held request keeps the drain open

pytestmark = pytest.mark.frontends  # the server tells its frontends when it drains, then stops them

SLOW_CONFIG = """name: "slow"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1, 256 ] } ]
"""


def test_sigterm_finishes_in_flight_requests(tmp_path):
    repo = tmp_path / "repo"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    (repo / "slow" / "1" / "model.onnx").write_bytes(slow_model())
    write_sleep_models(repo)
    server = start_pier([repo], log_path=tmp_path / "log")
    body = {"inputs": [{"name": "X", "shape": [1, 256], "datatype": "FP32", "data": [1.0] * 256}]}
    url = f"{server.base()}/v2/models/slow/infer"
    t0 = time.monotonic()
    assert requests.post(url, json=body, timeout=60).status_code == 200
    one = time.monotonic() - t0
    results: list[int | str] = []

    def call() -> None:
        try:
            results.append(requests.post(url, json=body, timeout=120).status_code)
        except requests.RequestException as exc:
            results.append(repr(exc))

    # kept-alive connections, idle when SIGTERM comes: one for an inference, two for the probes
    idle, ready_probe, live_probe = requests.Session(), requests.Session(), requests.Session()
    assert idle.post(url, json=body, timeout=60).status_code == 200
    assert ready_probe.get(f"{server.base()}/v2/health/ready", timeout=10).status_code == 200
    assert live_probe.get(f"{server.base()}/v2/health/live", timeout=10).status_code == 200
    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    # and one that holds the drain open for seconds, so that the requests sent after SIGTERM surely
    # come while it lasts (once nothing is in flight, an idle kept-alive connection is closed)
    held: dict[str, float | int | str] = {}

    def hold() -> None:
        sleep = {"inputs": [{"name": "SECONDS", "shape": [1], "datatype": "FP32", "data": [HOLD_S]}]}
        try:
            answer = requests.post(f"{server.base()}/v2/models/sleep_py/infer", json=sleep, timeout=60)
            held["status"] = answer.status_code
        except requests.RequestException as exc:
            held["status"] = repr(exc)
        held["done"] = time.monotonic()

    holder = threading.Thread(target=hold)
    holder.start()
    server.wait_for_log("sleep_py: sleeping")
    time.sleep(min(0.5, one / 2))  # all four accepted; one running, three queued
    unfinished = 4 - len(results)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    # while the four drain, both at once: a new connection (refused), and the kept-alive one (served, then closed)
    during: dict[str, requests.Response | Exception] = {}

    def send(key: str, session: requests.Session | None) -> None:
        try:
            during[key] = (session or requests).post(url, json=body, timeout=60)
        except requests.RequestException as exc:
            during[key] = exc

    sends = [threading.Thread(target=send, args=("late", None)), threading.Thread(target=send, args=("again", idle))]
    for t in sends:
        t.start()
    ready = ready_probe.get(f"{server.base()}/v2/health/ready", timeout=10)
    assert ready.status_code == 503 and "Server exiting" in ready.text, ready.text
    live = live_probe.get(f"{server.base()}/v2/health/live", timeout=10)
    assert live.status_code == 200  # draining, alive
    for t in threads + sends:
        t.join(120)
    sent_by = time.monotonic()
    holder.join(60)
    assert held["status"] == 200, (held, server.log())
    assert sent_by < held["done"], "the drain ended before the requests sent during it: test proves nothing"
    late, again = during["late"], during["again"]
    assert unfinished >= 2, f"requests finished before SIGTERM ({one:.3f}s each): test proves nothing"
    assert results == [200, 200, 200, 200], (results, server.log())
    assert isinstance(late, requests.ConnectionError) and "refused" in str(late), (late, server.log())
    assert isinstance(again, requests.Response) and again.status_code == 200, (again, server.log())
    for answer in (again, ready, live):
        assert answer.headers.get("Connection") == "close", answer.headers
    assert server.proc.wait(60) == 0
    assert "stopped" in server.log()


def test_a_stream_request_while_draining_gets_tritons_refusal(tmp_path):
    """On a gRPC stream, what was sent before SIGTERM finishes; a new request sent while the server
    drains is refused in Triton's words (its schedulers stop at SIGTERM): a stream has no
    `Connection: close` to end it after one more answer."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    repo = tmp_path / "repo"
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    (repo / "slow" / "1" / "model.onnx").write_bytes(slow_model())
    server = start_pier([repo], log_path=tmp_path / "log")
    got: list[tuple[str, str]] = []
    done = threading.Event()

    def callback(result, error) -> None:
        got.append(("error", str(error)) if error is not None else ("ok", result.get_response().id))
        if len(got) == 4:
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = grpcclient.InferInput("X", [1, 256], "FP32")
    x.set_data_from_numpy(np.ones((1, 256), np.float32))
    client.start_stream(callback)
    for i in range(3):  # one runs, two wait: the drain lasts until they are done
        client.async_stream_infer("slow", [x], request_id=f"before-{i}")
    time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    client.async_stream_infer("slow", [x], request_id="late")
    assert done.wait(60), (got, server.log())
    client.stop_stream()
    assert sorted(r for kind, r in got if kind == "ok") == ["before-0", "before-1", "before-2"], got
    refused = [r for kind, r in got if kind == "error"]
    assert len(refused) == 1 and "[request id: late] Server is stopping, scheduler for model has stopped " \
        "accepting new inference requests" in refused[0], got
    assert server.proc.wait(60) == 0


def _sleep_inputs(mod, seconds: float, count: int | None = None) -> list:
    import numpy as np

    from tests.conftest import numpy_inputs

    arrays = {"SECONDS": np.array([seconds], np.float32)}
    if count is not None:
        arrays["COUNT"] = np.array([count], np.int32)
    return numpy_inputs(mod, arrays)


def _sleep_server(tmp_path) -> PierProcess:
    repo = tmp_path / "repo"
    write_sleep_models(repo)
    return start_pier([repo], log_path=tmp_path / "log")


def test_grpc_after_sigterm_new_connections_are_refused_and_what_runs_finishes(tmp_path):
    """gRPC: the listener closes and every client gets GOAWAY. A unary call and a decoupled stream
    in flight finish; a new channel is refused; a channel opened before takes no new call (it must
    reconnect: to another pod, behind a Service)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    server = _sleep_server(tmp_path)
    old = grpcclient.InferenceServerClient(server.grpc_url)  # a channel opened before the signal
    assert old.is_server_ready()
    unary: dict[str, object] = {}

    def call() -> None:
        try:
            unary["answer"] = old.infer("sleep_py", _sleep_inputs(grpcclient, 1.5)).as_numpy("OUT").tolist()
        except InferenceServerException as exc:
            unary["answer"] = exc

    streamed: list[object] = []
    first = threading.Event()

    def callback(result, error) -> None:
        streamed.append(error if error is not None else int(result.as_numpy("OUT")[0]))
        first.set()

    streamer = grpcclient.InferenceServerClient(server.grpc_url)
    streamer.start_stream(callback)
    streamer.async_stream_infer("sleep_decoupled_py", _sleep_inputs(grpcclient, 0.4, 4), request_id="s")
    caller = threading.Thread(target=call)
    caller.start()
    assert first.wait(30), server.log()
    time.sleep(0.2)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(InferenceServerException) as refused:
        grpcclient.InferenceServerClient(server.grpc_url).is_server_live()
    assert "refused" in str(refused.value) or "failed to connect" in str(refused.value), refused.value
    with pytest.raises(InferenceServerException):  # GOAWAY: the next call reconnects, and is refused
        old.is_server_live()
    caller.join(60)
    streamer.stop_stream()  # waits for the stream's end
    assert unary["answer"] == [1.5], (unary, server.log())
    assert streamed == [0, 1, 2, 3], (streamed, server.log())
    assert server.proc.wait(60) == 0, server.log()


def test_http_streams_in_flight_finish_and_new_connections_are_refused(tmp_path):
    """A generate_stream (server-sent events) running when SIGTERM comes sends all its events;
    a new connection is refused meanwhile."""
    server = _sleep_server(tmp_path)
    url = f"{server.base()}/v2/models/sleep_decoupled_py/generate_stream"
    events: list[str] = []
    with requests.post(url, json={"SECONDS": 0.4, "COUNT": 4}, stream=True, timeout=60) as stream:
        lines = stream.iter_lines()
        events.extend(line.decode() for line in itertools.islice((x for x in lines if x), 1))
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(requests.ConnectionError, match="refused"):
            requests.get(f"{server.base()}/v2/health/live", timeout=10)
        events.extend(line.decode() for line in lines if line)
    assert [json.loads(e.removeprefix("data: "))["OUT"] for e in events] == [0, 1, 2, 3], events
    assert server.proc.wait(60) == 0, server.log()


@pytest.mark.llm
def test_an_openai_stream_in_flight_finishes(tmp_path):
    """The OpenAI API's streamed completion running when SIGTERM comes ends with its [DONE]; a
    new connection is refused meanwhile."""
    pytest.importorskip("transformers")
    openai = pytest.importorskip("openai")
    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path / "repo"
    build_model(repo / "tiny_llama" / "1", "llama", max_position_embeddings=2048)
    (repo / "tiny_llama" / "config.pbtxt").write_text(
        'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "8000000" } }\n')
    # 1500 tokens take ~10 s alone, far longer on two cores shared with other work: more than the
    # default 30 s exit timeout would allow (that bound has tests of its own: test_exit_timeout.py)
    server = start_pier([repo], "--exit-timeout-secs=300", log_path=tmp_path / "log", timeout=120)
    client = openai.OpenAI(base_url=f"{server.base()}/v1", api_key="none", max_retries=0)
    chunks, refused_at = [], 0
    stream = client.completions.create(model="tiny_llama", prompt="a story", max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 2:
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            with pytest.raises(openai.APIConnectionError):
                client.models.list()
            refused_at = len(chunks)
    assert chunks[-1].choices[0].finish_reason == "length", chunks[-1]
    assert len(chunks) > refused_at, "the stream ended before the refusal: the test proves nothing"
    assert server.proc.wait(60) == 0, server.log()
