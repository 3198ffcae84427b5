"""Qwen2: Llama's layers with a bias on q, k and v (always, none on o), and a sliding window only where
the config turns it on (`use_sliding_window`), on the layers from `max_window_layers` on (transformers
5.x writes them as `layer_types`; a 4.x config.json has no such list)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .hf_config import ArchConfig, arch_config
from .llama import LlamaForCausalLM


def qwen_windows(raw: dict[str, Any], cfg: ArchConfig) -> ArchConfig:
    """`cfg` with Qwen's sliding window: on only with `use_sliding_window`, from `max_window_layers` on."""
    window = cfg.sliding_window if raw.get("use_sliding_window") else None
    types = cfg.layer_types or tuple(
        "sliding_attention" if i >= int(raw.get("max_window_layers", 0)) else "full_attention"
        for i in range(cfg.num_layers))
    return replace(cfg, sliding_window=window, layer_types=types)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        cfg = qwen_windows(raw, arch_config(raw, architecture))
        return replace(cfg, qkv_bias=True, o_bias=False, mlp_bias=False)
