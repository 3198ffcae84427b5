"""Mistral: Llama's layers without biases; every layer attends through its `sliding_window` where the
config has one (the last `sliding_window` positions, attention.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .hf_config import ArchConfig, arch_config
from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        cfg = arch_config(raw, architecture)
        return replace(cfg, qkv_bias=False, o_bias=False, mlp_bias=False)
