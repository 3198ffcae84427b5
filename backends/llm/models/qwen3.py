"""Qwen3: Llama's layers with an RMSNorm over each head of q and of k before RoPE (`q_norm`, `k_norm`),
`head_dim` from the config (heads x head_dim differs from the hidden size in the real checkpoints),
q/k/v/o biases only with `attention_bias`, and Qwen2's sliding-window rule."""

from __future__ import annotations

from typing import Any

import torch

from ..attention import Workspace
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .hf_config import ArchConfig, arch_config
from .llama import LlamaDecoderLayer, LlamaForCausalLM
from .loader import WeightMap
from .qwen2 import qwen_windows


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ArchConfig, prefix: str, rope: RotaryEmbedding, workspace: Workspace,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, prefix, rope, workspace, dtype, device)
        self.q_norm = RMSNorm(prefix + "self_attn.q_norm", cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(prefix + "self_attn.k_norm", cfg.head_dim, cfg.rms_norm_eps)
        self.attn.qk_norm = (self.q_norm, self.k_norm)
        self.norms = (*self.norms, self.q_norm, self.k_norm)

    def weights(self, prefix: str, rope: RotaryEmbedding, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                into: WeightMap) -> None:
        super().weights(prefix, rope, cfg, dtype, device, into)
        for norm in (self.q_norm, self.k_norm):  # in the pair layout of the q and k rows
            def load(t: torch.Tensor, norm: RMSNorm = norm) -> None:
                norm.load(rope.interleave(t, 1), dtype, device)
            into.add(f"{norm.name}.weight", load)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer

    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        return qwen_windows(raw, arch_config(raw, architecture))
