"""Qwen2-MoE: Qwen2's attention (q/k/v biases with `qkv_bias`, Qwen2's sliding-window rule) with
Qwen3-MoE's sparse layers, plus a shared expert on each of them: a SiLU-gated MLP of
`shared_expert_intermediate_size` over every token, scaled by sigmoid(`shared_expert_gate`(x)) and
added to the routed experts' sum; checkpoint names `mlp.shared_expert.gate_proj/up_proj/down_proj`,
`mlp.shared_expert_gate`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..attention import Workspace
from ..layers.linear import Linear
from ..layers.rotary import RotaryEmbedding
from .hf_config import ArchConfig, arch_config
from .llama import LlamaDecoderLayer
from .mixtral import MixtralForCausalLM, MoEDecoderLayer
from .qwen2 import qwen_windows
from .qwen3_moe import Qwen3MoeDecoderLayer


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    moe_prefix = Qwen3MoeDecoderLayer.moe_prefix
    expert_names = Qwen3MoeDecoderLayer.expert_names
    moe_settings = staticmethod(Qwen3MoeDecoderLayer.moe_settings)

    def __init__(self, cfg: ArchConfig, prefix: str, rope: RotaryEmbedding, workspace: Workspace,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, prefix, rope, workspace, dtype, device)
        self.shared: tuple[Linear, Linear, Linear] | None = None
        width = int(cfg.raw.get("shared_expert_intermediate_size") or 0)
        if self.moe is not None and width:
            m, hidden = prefix + "mlp.", cfg.hidden_size
            self.shared = (Linear(m + "shared_expert.gate_up_proj", hidden, (width, width), False, dtype, device),
                           Linear(m + "shared_expert.down_proj", width, (hidden,), False, dtype, device),
                           Linear(m + "shared_expert_gate", hidden, (1,), False, dtype, device))
            self.linears = (*self.linears, *self.shared)

    def checkpoint_parts(self, prefix: str) -> list[tuple[Linear, tuple[str, ...]]]:
        parts = super().checkpoint_parts(prefix)
        if self.shared is None:
            return parts
        gate_up, down, gate = self.shared
        s = prefix + "mlp.shared_expert."
        return [*parts, (gate_up, (s + "gate_proj", s + "up_proj")), (down, (s + "down_proj",)), (gate, (gate.name,))]

    def mlp(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self.shared is None or self.moe is None:
            return super().mlp(x, h)
        gate_up, down, gate = self.shared
        shared = torch.sigmoid(gate(x)) * down(self.act(gate_up(x)))
        return self.moe(x, self.router(x), residual=h, shared=shared)


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    layer_class: type[LlamaDecoderLayer] = Qwen2MoeDecoderLayer

    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        bias = bool(raw.get("qkv_bias", True))
        return replace(qwen_windows(raw, arch_config(raw, architecture)), qkv_bias=bias, o_bias=False, mlp_bias=False)
