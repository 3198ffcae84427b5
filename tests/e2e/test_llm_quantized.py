"""Quantized weights on a real `pier serve` (issue 34, part 2): an online-int8 model and a GPTQ 4-bit
checkpoint serve through the OpenAI API, `vllm:cache_config_info` says what runs, and a corrupt GPTQ
checkpoint fails its own load naming the tensor while the others keep serving. (Token-for-token
equality with transformers: tests/backends/llm/test_quantization.py.)"""

from __future__ import annotations

import re

import pytest
import requests

from tests.conftest import PierProcess, start_pier

pytestmark = pytest.mark.llm

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

KV = 'parameters { key: "kv_cache_memory_bytes" value { string_value: "4000000" } }\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from safetensors.torch import load_file, save_file

    from tests.backends.llm.quant_checkpoints import quantized_pair
    from tests.backends.llm.tiny_model import build_model

    root = tmp_path_factory.mktemp("quant")
    float_dir = build_model(root / "float", "llama")
    gptq, _ = quantized_pair(float_dir, root / "packed", "gptq", 4, 32)
    broken, _ = quantized_pair(float_dir, root / "packed-broken", "gptq", 4, 32)
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.qzeros"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    repo = root / "repo"
    int8 = 'parameters { key: "quantization" value { string_value: "int8" } }\n'
    for model, folder, extra in (("int8", float_dir, int8), ("gptq", gptq, ""), ("broken", broken, "")):
        (repo / model).mkdir(parents=True)
        (repo / model / "1").symlink_to(folder, target_is_directory=True)
        (repo / model / "config.pbtxt").write_text('backend: "llm"\n' + KV + extra)
    proc = start_pier([repo], "--model-control-mode=explicit", log_path=root / "pier.log", timeout=120)
    yield proc
    assert proc.stop() == 0, proc.log()


def _load(server: PierProcess, model: str) -> requests.Response:
    return requests.post(f"{server.base()}/v2/repository/models/{model}/load", timeout=300)


def test_quantized_models_serve_and_a_corrupt_one_fails_alone(server: PierProcess) -> None:
    assert _load(server, "int8").status_code == 200
    assert _load(server, "gptq").status_code == 200
    bad = _load(server, "broken")
    assert bad.status_code == 400
    assert "model.layers.1.mlp.down_proj: qzeros has shape [4, 1], expected [4, 8]" in bad.text, bad.text
    client = openai.OpenAI(base_url=f"{server.base()}/v1", api_key="none")
    for model in ("int8", "gptq"):
        out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6 and out.model == model
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    info = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            info[labels["model_name"]] = (labels["quantization"], labels["weight_bits"])
    assert info == {"int8": ("int8", "8"), "gptq": ("gptq", "4")}, info
