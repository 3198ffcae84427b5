"""Mixtral: Llama's attention with a mixture-of-experts MLP in every layer (`layers.moe.FusedMoE`):
`num_local_experts` SiLU-gated experts, `num_experts_per_tok` of them per token, their softmax weights
renormalised over the chosen ones; checkpoint names `block_sparse_moe.gate` (the router) and
`block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down). `MoEDecoderLayer` is the shared part
(Qwen3-MoE's layer adds its own names and settings)."""

from __future__ import annotations

from typing import Any

import torch

from ..attention import AttentionMetadata, Workspace
from ..layers.linear import Linear
from ..layers.moe import FusedMoE
from ..layers.rotary import RotaryEmbedding
from .hf_config import ArchConfig, arch_config
from .interface import KVCache
from .llama import LlamaDecoderLayer, LlamaForCausalLM, layer_index
from .loader import WeightMap


class MoEDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose MLP is a `FusedMoE` where `moe_settings` says so (else Llama's dense MLP)."""

    moe_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")  # gate, up, down

    @staticmethod
    def moe_settings(cfg: ArchConfig, layer: int) -> tuple[int, int, int, bool] | None:
        """(experts, experts per token, expert width, renormalise) for layer `layer`, None when dense."""
        raw = cfg.raw
        return int(raw["num_local_experts"]), int(raw["num_experts_per_tok"]), cfg.intermediate_size, True

    def __init__(self, cfg: ArchConfig, prefix: str, rope: RotaryEmbedding, workspace: Workspace,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, prefix, rope, workspace, dtype, device)
        settings = self.moe_settings(cfg, layer_index(prefix))
        self.moe: FusedMoE | None = None
        if settings is not None:
            experts, top_k, inter, renormalize = settings
            name = prefix + self.moe_prefix
            self.router = Linear(name + "gate", cfg.hidden_size, (experts,), False, dtype, device)
            self.moe = FusedMoE(name + "experts", experts, top_k, cfg.hidden_size, inter, renormalize, dtype, device)
            self.linears = (self.qkv_proj, self.o_proj, self.router)

    def checkpoint_parts(self, prefix: str) -> list[tuple[Linear, tuple[str, ...]]]:
        parts = super().checkpoint_parts(prefix)
        if self.moe is None:
            return parts
        return [*parts[:2], (self.router, (self.router.name,))]

    def weights(self, prefix: str, rope: RotaryEmbedding, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                into: WeightMap) -> None:
        super().weights(prefix, rope, cfg, dtype, device, into)
        moe = self.moe
        if moe is None:
            return
        for e in range(moe.num_experts):
            for part, name in enumerate(self.expert_names):
                def load(t: torch.Tensor, e: int = e, part: int = part, moe: FusedMoE = moe) -> None:
                    moe.load(e, part, t)
                into.add(f"{moe.name}.{e}.{name}.weight", load)

    def finish(self) -> None:
        if self.moe is not None:
            self.moe.finish()

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, rotations: torch.Tensor | None,  # type: ignore[override]
                 kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream with this layer's attention and MLP outputs added (in place)."""
        x = self.input_layernorm(h)
        h = self.o_proj(self.attn(self.qkv_proj(x), positions, rotations, kv_cache, meta), residual=h)
        return self.mlp(self.post_attention_layernorm(h), h)

    def mlp(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The residual stream `h` with the MLP's output for `x` (its normed input) added."""
        if self.moe is None:
            return self.down_proj(self.act(self.gate_up_proj(x)), residual=h)
        return self.moe(x, self.router(x), residual=h)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class: type[LlamaDecoderLayer] = MoEDecoderLayer

    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        return arch_config(raw, architecture)  # Mixtral's sliding_window, where set, on every layer

    def load_weights(self, weights: Any) -> None:
        super().load_weights(weights)
        for layer in self.layers:
            assert isinstance(layer, MoEDecoderLayer)
            layer.finish()

    def use_kernels(self, ops: Any) -> None:
        super().use_kernels(ops)
        for layer in self.layers:
            assert isinstance(layer, MoEDecoderLayer)
            if layer.moe is not None:
                layer.moe.use_kernels(ops)
