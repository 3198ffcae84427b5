"""`pier serve PATH` for one model: a Hugging Face folder answers the OpenAI API under the folder's
name (or --served-model-name), token for token as transformers' greedy decoding; an .onnx file
answers tritonclient; the completed config is logged; a corrupt GGUF file fails its load naming the file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from scripts.build_example_models import identity_model
from tests.conftest import ROOT, numpy_inputs, start_pier

openai = pytest.importorskip("openai")
httpclient = pytest.importorskip("tritonclient.http")


@pytest.mark.llm
def test_a_hugging_face_folder_answers_openai_under_its_name(tmp_path: Path) -> None:
    from tests.backends.llm.tiny_model import build_model, hf_greedy

    folder = build_model(tmp_path / "tiny-chat", "llama")
    server = start_pier([], str(folder), log_path=tmp_path / "pier.log", timeout=120)
    try:
        client = openai.OpenAI(base_url=f"{server.base()}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        prompt = [5, 6, 7, 8, 9]
        c = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        ids = [int(t.split(":")[1]) for t in c.choices[0].logprobs.tokens]
        assert ids == hf_greedy(folder, [prompt], 12)[0]
        log = server.log()
        assert f"serving {folder} as 'tiny-chat'; its configuration, completed:" in log
        assert r'\"backend\": \"llm\"' in log and r'\"text_input\"' in log  # auto-complete's tensors
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.llm
def test_served_model_name_names_it(tmp_path: Path) -> None:
    from tests.backends.llm.tiny_model import build_model

    folder = build_model(tmp_path / "weights", "qwen2", shard_size="100KB")
    server = start_pier([], str(folder), "--served-model-name=assistant", log_path=tmp_path / "pier.log",
                        timeout=120)
    try:
        client = openai.OpenAI(base_url=f"{server.base()}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["assistant"]
        chat = client.chat.completions.create(model="assistant", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.model == "assistant" and chat.usage.completion_tokens >= 1
        # Its load, shard by shard, one log line each (the log is no terminal): issue 32, part 5.
        shards = len(list(folder.glob("*.safetensors")))
        lines = re.findall(r"'assistant' version 1: loading weights: (\d+)/(\d+) shards", server.log())
        assert shards >= 3 and lines == [(str(i), str(shards)) for i in range(shards + 1)]
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.llm
def test_model_ready_says_why_a_model_is_not(tmp_path: Path) -> None:
    from tests.backends.llm.tiny_model import build_model

    folder = build_model(tmp_path / "odd", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    server = start_pier([], str(folder), "--exit-on-error=false", "--strict-readiness=false",
                        log_path=tmp_path / "pier.log")
    try:
        r = requests.get(f"{server.base()}/v2/models/odd/ready", timeout=5)
        doc = r.json()
        assert r.status_code == 400 and (doc["error"], doc["state"]) == ("Model version not ready", "UNAVAILABLE")
        assert "unsupported architecture 'GPT2LMHeadModel'" in doc["reason"]
        r = requests.get(f"{server.base()}/v2/models/other/ready", timeout=5)  # unknown: Triton's body
        assert r.status_code == 400 and r.json() == {"error": "Model version not ready"}
    finally:
        assert server.stop() == 0, server.log()


def test_an_onnx_file_answers_tritonclient(tmp_path: Path) -> None:
    path = tmp_path / "echo.onnx"
    path.write_bytes(identity_model("FP32", [-1, -1]))
    server = start_pier([], str(path), log_path=tmp_path / "pier.log")
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.is_model_ready("echo")
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        out = client.infer("echo", numpy_inputs(httpclient, {"INPUT0": x})).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(out, x)
        config = client.get_model_config("echo")
        assert config["max_batch_size"] == 4 and config["dynamic_batching"] is not None  # auto-completed
        assert r"as 'echo'; its configuration, completed: {" in server.log()
        assert r'\"platform\": \"onnxruntime_onnx\"' in server.log()
    finally:
        assert server.stop() == 0, server.log()
    assert path.read_bytes() == identity_model("FP32", [-1, -1])  # nothing written beside the model


def test_a_corrupt_gguf_file_fails_its_load_naming_the_file(tmp_path: Path) -> None:
    """A .gguf file is served by the LLM backend (tests/e2e/test_llm_gguf.py serves a real one); a
    corrupt one fails the load, named, and the server exits as --exit-on-error says."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    done = subprocess.run([sys.executable, "-m", "pier", "serve", str(path), "--http-port=0", "--grpc-port=0",
                           "--metrics-port=0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "GGUF file model.gguf: cannot be read" in done.stderr, done.stderr


SMOLLM2 = ROOT / "build" / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.llm
@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(), reason="make smollm2 builds the README's LLM")
def test_the_readme_llm_answers_sensibly(tmp_path: Path) -> None:
    """The README's tour: `make serve-llm` (pier serve on the converted SmolLM2-135M-Instruct)."""
    server = start_pier([], str(SMOLLM2), log_path=tmp_path / "pier.log", timeout=180)
    try:
        client = openai.OpenAI(base_url=f"{server.base()}/v1", api_key="unused")
        chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=40, temperature=0,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    finally:
        assert server.stop() == 0, server.log()
