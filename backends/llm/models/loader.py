"""Read a Hugging Face-format model folder: config.json, (sharded) safetensors, generation config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the model code needs, normalised across Llama / Mistral / Qwen2."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        """Parse config.json (+ generation_config.json for EOS ids). Raises ValueError if unsupported."""
        path = folder / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {folder}")
        raw = json.loads(path.read_text())
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_params = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
            rope_scaling = rope_params
        theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        eos = _ids(raw.get("eos_token_id"))
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
            eos = eos + tuple(i for i in _ids(gen.get("eos_token_id")) if i not in eos)
        is_qwen = arch == "Qwen2ForCausalLM"
        sliding = raw.get("sliding_window") if (not is_qwen or raw.get("use_sliding_window")) else None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)) or is_qwen,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=int(sliding) if sliding else None,
        )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"weight files named by the index are missing: {', '.join(missing)}")
    return files


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every weight file, loaded on CPU one at a time."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
