"""Qwen2: Llama's layers with a bias on q, k and v (always, none on o), and a sliding window only where
the config turns it on (`use_sliding_window`); it then caps the context, as for Mistral."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .hf_config import ArchConfig, arch_config
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        cfg = arch_config(raw, architecture)
        window = cfg.sliding_window if raw.get("use_sliding_window") else None
        return replace(cfg, qkv_bias=True, o_bias=False, mlp_bias=False, sliding_window=window)
