"""Tensor parallelism under a real `pier serve`: a model on two ranks (`tensor_parallel_size: 2`)
answers as on one; `kill -9` of rank 1 under load fails that model's requests in flight with a
message naming the rank, while an ONNX model keeps serving without a failure; the model is
UNAVAILABLE with the reason, the group restarts (the engine core and its ranks) and serves again
within two minutes; shutdown leaves no process, socket folder or shared-memory segment behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import EXAMPLE_REPO, private_tmpdir, start_pier
from tests.e2e.test_llm_engine_process import Hammer, _alive, _children, _cmdline, _core_dirs, _engine_pids

pytestmark = pytest.mark.llm

pytest.importorskip("transformers")
httpclient = pytest.importorskip("tritonclient.http")

LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
CONFIG = ('backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "4000000" } }\n'
          'parameters { key: "num_threads" value { string_value: "1" } }\n')


def _ranks(server_pid: int) -> list[int]:
    """The worker ranks (1..N-1): children of the engine core."""
    return [p for core in _engine_pids(server_pid) for p in _children(core)
            if "pier.backends.llm.parallel.worker" in _cmdline(p)]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _state(base: str, model: str) -> tuple[str, str]:
    rows = requests.post(f"{base}/v2/repository/index", json={}, timeout=10).json()
    row = next(r for r in rows if r["name"] == model)
    return row.get("state", ""), row.get("reason", "")


def _generate(base: str, model: str, text: str, params: dict) -> requests.Response:
    return requests.post(f"{base}/v2/models/{model}/generate", timeout=120,
                         json={"text_input": text, "sampling_parameters": json.dumps(params)})


def _three_running(pool: ThreadPoolExecutor, server: Any, model: str) -> list[Future[requests.Response]]:
    """Three long generations of `model` sent through `pool`, returned once the engine runs all three."""
    futures = [pool.submit(_generate, server.base(), model, f"prompt {i}", LONG) for i in range(3)]
    deadline = time.monotonic() + 60
    while requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text.find(
            f'vllm:num_requests_running{{model_name="{model}"}} 3') < 0:
        assert time.monotonic() < deadline, "the requests never ran"
        time.sleep(0.05)
    return futures


def test_two_ranks_and_kill_9_of_one(tmp_path: Path) -> None:
    from tests.backends.llm.tiny_model import build_model

    repo = tmp_path / "repo"
    build_model(repo / "tp2" / "1", "llama")
    (repo / "tp2" / "config.pbtxt").write_text(
        CONFIG + 'parameters { key: "tensor_parallel_size" value { string_value: "2" } }\n')
    shutil.copytree(repo / "tp2" / "1", repo / "tp1" / "1")
    (repo / "tp1" / "config.pbtxt").write_text(CONFIG)
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    tmp = tmp_path / "tmp"  # the server's own temporary folder: its socket folders are checked at the end
    shm_before = set(os.listdir("/dev/shm"))
    server = start_pier([repo], log_path=tmp_path / "pier.log", timeout=180, env=private_tmpdir(tmp_path))
    base = server.base()
    seen: list[int] = []
    try:
        greedy = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
        one = _generate(base, "tp1", "The quick brown fox", greedy)
        two = _generate(base, "tp2", "The quick brown fox", greedy)
        assert one.status_code == two.status_code == 200, (one.text, two.text)
        assert one.json()["text_output"] == two.json()["text_output"]
        ranks = _ranks(server.proc.pid)
        assert len(ranks) == 1, (ranks, _engine_pids(server.proc.pid))
        core = _parent(ranks[0])  # tp2's engine core: rank 0
        seen += [*ranks, core]

        hammer = Hammer(server.http_url)  # the other model, the whole time: not one failure allowed

        with ThreadPoolExecutor(3) as pool:
            futures = _three_running(pool, server, "tp2")
            os.kill(ranks[0], signal.SIGKILL)
            killed_at = time.monotonic()
            answers = [f.result() for f in futures]
            failed_within = time.monotonic() - killed_at
            states: list[tuple[str, str]] = []
            deadline = killed_at + 120
            while (requests.get(f"{base}/v2/models/tp2/ready", timeout=10).status_code != 200
                   or len(_ranks(server.proc.pid)) != 1):
                assert time.monotonic() < deadline, server.log()[-3000:]
                states.append(_state(base, "tp2"))
                time.sleep(0.05)
            back_within = time.monotonic() - killed_at
        for r in answers:  # in flight: failed, the rank named
            assert r.status_code == 503, r.text
            why = f"tensor-parallel rank 1 of 2 (pid {ranks[0]}) killed by signal 9 (SIGKILL)"
            assert why in r.json()["error"], r.text
        assert failed_within < 15 and back_within < 120
        assert any(s == "UNAVAILABLE" and "tensor-parallel rank 1" in why for s, why in states), states
        new_ranks = _ranks(server.proc.pid)
        seen += [*new_ranks, _parent(new_ranks[0])]
        assert not _alive(ranks[0]) and not _alive(core)  # the whole group is new
        again = _generate(base, "tp2", "The quick brown fox", greedy)
        assert again.status_code == 200 and again.json()["text_output"] == one.json()["text_output"], again.text
        hammer.stop_and_check()
    finally:
        stop_code = server.stop()
    assert stop_code == 0, server.log()[-3000:]
    assert not any(_alive(p) for p in seen), "a rank or an engine process outlived the server"
    assert not _core_dirs(tmp), "the engine's socket folder was left behind"
    mine = f"pier-tp-{server.proc.pid}-"  # (other servers on this machine may hold theirs meanwhile)
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(mine)], \
        "a shared-memory segment was left behind"


def test_lora_adapters_on_two_ranks_equal_peft(tmp_path: Path) -> None:
    """A model on two ranks with LoRA on: a startup adapter (`lora_modules`) and one loaded through
    /v1/load_lora_adapter answer the openai SDK, base and both adapters at once, with PEFT's greedy
    tokens (each rank holds its share of every adapter)."""
    pytest.importorskip("openai")
    pytest.importorskip("peft")
    from tests.backends.llm.tiny_model import build_adapter, build_model, peft_greedy
    from tests.e2e.test_llm_lora import N, check_at_once

    repo = tmp_path / "repo"
    base = build_model(repo / "base" / "1", "llama")
    adapters = {"a1": build_adapter(base, repo / "base" / "adapters" / "a1", 1, r=8, alpha=16),
                "a2": build_adapter(base, tmp_path / "a2", 2, r=4, alpha=8, use_rslora=True,
                                    targets=("q_proj", "v_proj", "down_proj"))}
    params = {"enable_lora": "true", "max_loras": "2", "tensor_parallel_size": "2",
              "lora_modules": json.dumps([{"name": "a1", "path": "adapters/a1"}])}
    (repo / "base" / "config.pbtxt").write_text(CONFIG + "".join(
        f'parameters {{ key: "{k}" value {{ string_value: {json.dumps(v)} }} }}\n' for k, v in params.items()))
    prompts = [[7, 42, 99, 5], [300, 12, 8, 77, 150, 3, 64, 201, 9]]
    refs = {name: peft_greedy(base, path, prompts, N) for name, path in {None: None, **adapters}.items()}
    server = start_pier([repo], log_path=tmp_path / "pier.log", timeout=180, env=private_tmpdir(tmp_path))
    try:
        loaded = requests.post(server.base() + "/v1/load_lora_adapter", timeout=60,
                               json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
        assert loaded.status_code == 200, loaded.text
        check_at_once(server.base(), prompts, refs)
        assert len(_ranks(server.proc.pid)) == 1
    finally:
        assert server.stop() == 0, server.log()[-3000:]
