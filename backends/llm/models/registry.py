"""Which model file serves a checkpoint: config.json's `architectures[0]` -> module, imported on first use.

Adding an architecture is one file under `models/` (a class following `interface.CausalLM`, usually
composed of `layers/`) and one row here. A checkpoint whose architecture is not listed fails its load
with a message listing those that are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from pier.contract.backend import LoadProgress

from .. import kernels
from ..kv_fp8 import checkpoint_kv_scales
from . import gguf, quantization
from .hf_config import ArchConfig, read_config
from .interface import CausalLM
from .loader import iter_weights
from .quantization import QuantConfig

# architecture (config.json) -> (module under models/, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
_DEFAULT = "LlamaForCausalLM"  # a config.json without `architectures` (early Llama conversions)


def architectures() -> tuple[str, ...]:
    """The architectures Pier serves, sorted."""
    return tuple(sorted(_MODELS))


def model_class(architecture: str) -> type[CausalLM]:
    """The class serving `architecture`, importing its module now. ValueError when unknown."""
    try:
        module, name = _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(architectures())}"
                         ) from None
    return cast("type[CausalLM]", getattr(importlib.import_module(f"{__package__}.{module}"), name))


def resolve_quantization(folder: Path, setting: str | None) -> QuantConfig | None:
    """The weight quantization that runs for the checkpoint in `folder` under the `quantization` setting
    (a GGUF file's: its tensors' own types, models/gguf.py)."""
    path = gguf.find(folder)
    if path is None:
        return quantization.resolve(setting, read_config(folder))
    if setting not in (None, "gguf"):
        raise ValueError(f"quantization {setting!r}: {path.name} is a GGUF file, whose tensors say how they are "
                         "stored (leave quantization unset, or 'gguf')")
    return gguf.quant_config(path)


def raw_config(folder: Path) -> dict[str, Any]:
    """config.json's fields: the file's own, or a GGUF file's metadata as those fields."""
    path = gguf.find(folder)
    return read_config(folder) if path is None else gguf.config(path)


def resolve(folder: Path) -> tuple[type[CausalLM], ArchConfig]:
    """The model class and its normalised config for the checkpoint in `folder`."""
    raw = raw_config(folder)
    archs: Any = raw.get("architectures") or [_DEFAULT]
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError(f"config.json: architectures must be a list of names, got {archs!r}")
    cls = model_class(archs[0])
    return cls, cls.arch_config(raw, archs[0])


def load_model(folder: Path, cls: type[CausalLM], config: ArchConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, progress: Callable[[LoadProgress], None] | None = None,
               prepare: Callable[[CausalLM], None] | None = None, quant: QuantConfig | None = None,
               kv_scales: dict[int, dict[str, float]] | None = None) -> CausalLM:
    """Build `cls` and load the folder's safetensors (or GGUF file) into it (`progress`: loader.iter_weights');
    `prepare` sees the model built, before its weights (a tensor-parallel rank's split, parallel/shard.py);
    with `quant`, its decoder projections are packed (models/quantization.py); `kv_scales` receives
    the checkpoint's per-layer KV cache scales (kv_fp8.checkpoint_kv_scales)."""
    model = cls(config, dtype, device, max_positions)
    if prepare is not None:
        prepare(model)
    if quant is not None:
        ops = kernels.load() if device.type == "cpu" else None
        projections = quantization.apply(model, quant, ops)
    path = gguf.find(folder)
    weights = iter_weights(folder, progress) if path is None else gguf.iter_weights(path, config.raw)
    if kv_scales is not None:
        weights = checkpoint_kv_scales(weights, kv_scales)
    model.load_weights(quantization.translate(weights, quant))
    if quant is not None:
        quantization.log_summary(quant, model, projections)
    return model
