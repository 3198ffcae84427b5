"""Quantized weights (issue 34, part 2): online int8 and published 4/8-bit checkpoints give, greedy and
token for token, what transformers gives running their de-quantized weights; malformed ones fail the
load naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.layers.quantized import PackedWeight
from pier.backends.llm.sampling_params import SamplingParams

from .quant_checkpoints import int8_reference, quantized_pair
from .tiny_model import hf_greedy

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def engine(folder: Path, **kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    return LLMEngine(folder, EngineConfig(**kw))  # type: ignore[arg-type]


def packed_projections(eng: LLMEngine) -> list[PackedWeight]:
    return [lin.weight for layer in eng.model.layers for lin in layer.linears  # type: ignore[attr-defined]
            if isinstance(lin.weight, PackedWeight)]


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_int8_equals_transformers_on_dequantized_weights(llama_dir, prompts, tmp_path, attention):
    """Both paths: the packed-weight kernel (CPU float32; decode rows fused, prefill de-quantized once)
    and, with attention "torch", the same kernel under the torch attention path."""
    reference = hf_greedy(int8_reference(llama_dir, tmp_path / "int8-ref"), prompts, 16)
    eng = engine(llama_dir, quantization="int8", attention=attention)
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == reference
    packed = packed_projections(eng)
    assert len(packed) == 8 and all(p.bits == 8 for p in packed)  # 2 layers x qkv, o, gate_up, down
    assert eng.model.embed_tokens.weight.dtype == torch.float32  # type: ignore[attr-defined]
    assert eng.model.lm_head.linear is not None and not isinstance(eng.model.lm_head.linear.weight, PackedWeight)
    info = eng.cache_config_info()
    assert (info["quantization"], info["weight_bits"]) == ("int8", "8")


def test_int8_torch_fallback_equals_the_kernel(llama_dir, prompts):
    """Without the compiled kernel (no compiler, CUDA, 16-bit activations) the weights are
    de-quantized in torch: the same tokens."""
    eng = engine(llama_dir, quantization="int8")
    want = eng.generate(prompts, GREEDY)
    for layer in eng.model.layers:  # type: ignore[attr-defined]
        for lin in layer.linears:
            lin.method.ops = None
    assert eng.generate(prompts, GREEDY) == want


@pytest.mark.parametrize(("fmt", "bits", "desc_act", "sym"), [
    ("gptq", 4, False, False), ("gptq", 4, True, False), ("gptq", 8, True, True), ("gptq", 8, False, False),
    ("awq", 4, False, False), ("compressed-tensors", 4, False, True), ("compressed-tensors", 8, False, True),
])
def test_checkpoint_equals_transformers_on_dequantized_weights(llama_dir, prompts, tmp_path, fmt, bits, desc_act,
                                                               sym):
    quantized, dequantized = quantized_pair(llama_dir, tmp_path, fmt, bits, 32, desc_act, sym)
    reference = hf_greedy(dequantized, prompts, 16)
    eng = engine(quantized)
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == reference
    packed = packed_projections(eng)
    assert len(packed) == 8 and all(p.bits == bits and p.group == 32 for p in packed)
    assert all((p.perm is not None) == desc_act for p in packed)
    assert eng.cache_config_info()["quantization"] == fmt


def test_checkpoint_setting_must_match(llama_dir, tmp_path):
    quantized, _ = quantized_pair(llama_dir, tmp_path, "gptq", 4)
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* `quantization` argument \(int8\)"):
        engine(quantized, quantization="int8")
    with pytest.raises(ValueError, match="quantization 'awq' needs a checkpoint quantized that way"):
        engine(llama_dir, quantization="awq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig.from_parameters({"quantization": "fp4"})


def test_malformed_checkpoint_names_the_tensor(llama_dir, tmp_path):
    quantized, _ = quantized_pair(llama_dir, tmp_path, "gptq", 4)
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.down_proj.qzeros"] = tensors["model.layers.1.mlp.down_proj.qzeros"][:, :1].contiguous()
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj: qzeros has shape \[4, 1\], "
                                         r"expected \[4, 8\]"):
        engine(quantized)
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.qzeros missing"):
        engine(quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="checkpoint_format 'gptq_v2' is not supported"):
        engine(quantized)


def test_corrupt_safetensors_file_is_named(llama_dir, tmp_path):
    quantized, _ = quantized_pair(llama_dir, tmp_path, "awq", 4)
    path = quantized / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        engine(quantized)
