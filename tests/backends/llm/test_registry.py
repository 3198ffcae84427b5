"""The model registry: an architecture is one file under models/ plus a registry row; config.json of
transformers 4.x and 5.x; a checkpoint the registry or the model cannot take fails its load by name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.models import registry
from pier.backends.llm.sampling_params import SamplingParams

from .tiny_model import build_model, hf_greedy

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
BACKENDS = Path(registry.__file__).resolve().parents[2]


def engine(folder: Path) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))


def test_each_architecture_is_its_own_file_imported_on_first_use():
    for arch in registry.architectures():
        module, _ = registry._MODELS[arch]
        assert (BACKENDS / "llm" / "models" / f"{module}.py").is_file()
    code = ("import sys; from pier.backends.llm.models import registry as r; "
            "assert 'pier.backends.llm.models.qwen2' not in sys.modules; "
            "assert r.model_class('Qwen2ForCausalLM').__module__ == 'pier.backends.llm.models.qwen2'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_qwen2_with_its_own_head_dim_equals_transformers(tmp_path, prompts):
    """Qwen2 (q/k/v biases, no o bias) with head_dim 32 while hidden / heads is 16, and tied embeddings."""
    folder = build_model(tmp_path / "qwen2", "qwen2", seed=5, head_dim=32, tie_word_embeddings=True)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["head_dim"] * 4 != raw["hidden_size"]
    eng = engine(folder)
    assert type(eng.model).__name__ == "Qwen2ForCausalLM" and eng.model_config.head_dim == 32
    layer = eng.model.layers[0]
    assert layer.qkv_proj.bias is not None and layer.o_proj.bias is None
    ref = hf_greedy(folder, prompts, 32)
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == ref


def _as_transformers_4(folder: Path) -> None:
    """Rewrite config.json the way transformers 4.x wrote it: rope_theta and rope_scaling, no rope_parameters."""
    raw = json.loads((folder / "config.json").read_text())
    params = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = None if params.get("rope_type") == "default" else params
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "beta_fast": 16.0,
     "attention_factor": 0.9},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_rope_scaling_from_either_config_format(tmp_path, prompts, rope):
    folder = build_model(tmp_path / "new", "llama", seed=6, rope_theta=500.0, rope_scaling=rope)
    assert "rope_parameters" in json.loads((folder / "config.json").read_text())  # transformers 5.x's form
    new = engine(folder)
    if rope["rope_type"] != "dynamic":  # transformers recomputes dynamic NTK per length; vLLM and Pier do not
        assert [o[0] for o in new.generate(prompts, GREEDY)] == hf_greedy(folder, prompts, 32)
    _as_transformers_4(folder)
    old = engine(folder)
    assert old.model_config.rope == new.model_config.rope and old.model_config.rope_theta == 500.0
    assert old.generate(prompts[:2], GREEDY) == new.generate(prompts[:2], GREEDY)


def test_unknown_architecture_names_the_known_ones(tmp_path):
    folder = build_model(tmp_path / "m", "llama")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "architectures": ["GemmaForCausalLM"]}))
    known = ", ".join(registry.architectures())
    assert known.startswith("Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM")
    with pytest.raises(ValueError, match=re.escape(f"'GemmaForCausalLM'; supported: {known}")):
        engine(folder)


def test_missing_or_misshapen_tensor_fails_the_load_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = build_model(tmp_path / "m", "llama")
    path = folder / "model.safetensors"
    weights = load_file(path)
    down = weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight missing"):
        engine(folder)
    save_file({**weights, "model.layers.1.mlp.down_proj.weight": down.t().contiguous()}, path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: weight of slice 0 has shape \[128, 64\]"):
        engine(folder)


def test_unsupported_activation_fails_the_load(tmp_path):
    folder = build_model(tmp_path / "m", "llama", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        engine(folder)
