"""The LLM engine in its own process, under a real `pier serve`: `kill -9` of the engine-core process
under load fails the requests in flight at once with a message naming the cause, the model is
UNAVAILABLE with that reason (strict readiness says so) while an ONNX model keeps serving without a
single failure, the core restarts and the model serves again, and shutdown leaves no process,
socket folder or shared-memory segment behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.conftest import EXAMPLE_REPO, private_tmpdir, start_pier

pytestmark = pytest.mark.llm

pytest.importorskip("transformers")
httpclient = pytest.importorskip("tritonclient.http")

LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


class Hammer:
    """The example `simple` model (INT32 add) asked over and over on a thread of its own while a test
    breaks another model, which must not cost it one failure: `ok`, `failed` and the `errors` seen."""

    def __init__(self, url: str) -> None:
        self.url, self.ok, self.failed, self.errors = url, 0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client = httpclient.InferenceServerClient(self.url)
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        while not self._stop.is_set():
            inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
                      httpclient.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(a)
            try:
                assert (client.infer("simple", inputs).as_numpy("OUTPUT0") == a + a).all()
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - counted, and shown on failure
                self.failed += 1
                self.errors.append(repr(exc))

    def stop_and_check(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert self.failed == 0 and self.ok > 0, (self.ok, self.failed, self.errors[:3])


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid` (a child belongs to the thread that started it)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _engine_pids(server_pid: int) -> list[int]:
    return [p for p in _children(server_pid) if "pier.backends.llm.engine_core" in _cmdline(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def _core_dirs(tmp: Path) -> set[str]:
    return {p.name for p in tmp.glob("pier-llm-core-*")}


def _index_state(base: str) -> tuple[str, str]:
    rows = requests.post(f"{base}/v2/repository/index", json={}, timeout=10).json()
    row = next(r for r in rows if r["name"] == "tiny_llama")
    return row.get("state", ""), row.get("reason", "")


@pytest.mark.slow
def test_kill_9_of_the_engine_process(tmp_path: Path) -> None:
    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path / "repo"
    build_model(repo / "tiny_llama" / "1", "llama")
    (repo / "tiny_llama" / "config.pbtxt").write_text(
        'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "8000000" } }\n')
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    # The server's temporary folder is this test's own: other servers on the machine (tests run
    # side by side) make and remove their engines' socket folders in the shared one meanwhile.
    tmp = tmp_path / "tmp"
    shm_before = set(os.listdir("/dev/shm"))
    server = start_pier([repo], log_path=tmp_path / "pier.log", timeout=120, env=private_tmpdir(tmp_path))
    base = server.base()
    try:
        engines = _engine_pids(server.proc.pid)
        assert len(engines) == 1, (engines, _children(server.proc.pid))
        assert len(_core_dirs(tmp)) == 1  # its socket folder, where the check at the end looks
        first = engines[0]

        hammer = Hammer(server.http_url)  # the other model, the whole time: not one failure allowed

        def long_generate(i: int) -> requests.Response:
            return requests.post(f"{base}/v2/models/tiny_llama/generate", timeout=120,
                                 json={"text_input": f"prompt {i}", "sampling_parameters": json.dumps(LONG)})

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(long_generate, i) for i in range(4)]
            deadline = time.monotonic() + 60  # wait until they are generating
            while requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text.find(
                    'vllm:num_requests_running{model_name="tiny_llama"} 4') < 0:
                assert time.monotonic() < deadline, "the requests never ran"
                time.sleep(0.05)
            os.kill(first, signal.SIGKILL)
            killed_at = time.monotonic()
            answers = [f.result() for f in futures]
            failed_within = time.monotonic() - killed_at
            # until it is back by itself: the model's state, strict readiness and model readiness
            states: list[tuple[str, str]] = []
            ready_codes: set[int] = set()
            model_ready: list[int] = []
            deadline = time.monotonic() + 90
            while not model_ready or model_ready[-1] != 200 or len(_engine_pids(server.proc.pid)) != 1:
                assert time.monotonic() < deadline, server.log()[-3000:]
                states.append(_index_state(base))
                ready_codes.add(requests.get(f"{base}/v2/health/ready", timeout=10).status_code)
                model_ready.append(requests.get(f"{base}/v2/models/tiny_llama/ready", timeout=10).status_code)
                time.sleep(0.05)
        for r in answers:  # in flight: failed at once, the cause named
            assert r.status_code == 503, r.text
            assert f"pid {first}" in r.json()["error"] and "killed by signal 9 (SIGKILL)" in r.json()["error"], r.text
        assert failed_within < 10
        # UNAVAILABLE with the reason while the new core loads (seconds: it imports torch, loads weights)
        assert any(s == "UNAVAILABLE" and "SIGKILL" in why for s, why in states), states
        assert "is UNAVAILABLE: the LLM engine process" in server.log()
        assert 400 in ready_codes and model_ready[0] != 200  # readiness said so (Triton's codes: 400)
        assert _index_state(base) == ("READY", "")
        again = _engine_pids(server.proc.pid)
        assert len(again) == 1 and again[0] != first and not _alive(first)
        r = requests.post(f"{base}/v2/models/tiny_llama/generate", timeout=60,
                          json={"text_input": "back", "sampling_parameters": json.dumps({"max_tokens": 4})})
        assert r.status_code == 200 and r.json()["text_output"], r.text
        assert requests.get(f"{base}/v2/health/ready", timeout=10).status_code == 200

        hammer.stop_and_check()
    finally:
        stop_code = server.stop()
    assert stop_code == 0, server.log()[-3000:]
    assert not any(_alive(p) for p in (first, *again)), "an engine process outlived the server"
    assert not _core_dirs(tmp), "the engine's socket folder was left behind"
    assert set(os.listdir("/dev/shm")) <= shm_before, "a shared-memory segment was left behind"
