"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's layers, with q/k/v and gate/up fused in the checkpoint
(`qkv_proj`, `gate_up_proj`: split here into the fused `Linear`'s slices, q and k rows into RoPE's pair
layout), `partial_rotary_factor` (Phi-4-mini rotates 3/4 of each head) and LongRoPE scaling
(layers/rotary.py); its `sliding_window`, where the config has one, on every layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..layers.linear import Linear
from ..layers.quantized import PackedWeight
from ..layers.rotary import RotaryEmbedding
from .hf_config import ArchConfig, arch_config
from .llama import LlamaDecoderLayer, LlamaForCausalLM
from .loader import WeightMap


class Phi3DecoderLayer(LlamaDecoderLayer):
    def weights(self, prefix: str, rope: RotaryEmbedding, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                into: WeightMap) -> None:
        for norm in self.norms:
            into.add(f"{norm.name}.weight", norm.loader(dtype, device))
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        rotate = (nh, nkv, None)

        def split(linear: Linear, name: str, kind: str) -> Callable[[torch.Tensor | PackedWeight], None]:
            def load(t: torch.Tensor | PackedWeight) -> None:
                sizes = linear.checkpoint_sizes  # the checkpoint's, also on a tensor-parallel rank
                if t.shape[0] != sum(sizes):
                    raise ValueError(f"{name}: {kind} has {t.shape[0]} rows, expected {sum(sizes)}")
                starts = [sum(sizes[:i]) for i in range(len(sizes))]  # a quantized one stays packed
                parts = (t.split(list(sizes)) if isinstance(t, torch.Tensor) else
                         [t.rows(a, n) for a, n in zip(starts, sizes, strict=True)])
                for i, part in enumerate(parts):
                    heads = rotate[i] if linear is self.qkv_proj else None
                    linear.load(i, part if heads is None else rope.interleave(part, heads), kind)
            return load

        a, m = prefix + "self_attn.", prefix + "mlp."
        for linear, name in ((self.qkv_proj, a + "qkv_proj"), (self.o_proj, a + "o_proj"),
                             (self.gate_up_proj, m + "gate_up_proj"), (self.down_proj, m + "down_proj")):
            for kind in ("weight", "bias") if linear.has_bias else ("weight",):
                into.add(f"{name}.{kind}", split(linear, name, kind))


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_class = Phi3DecoderLayer

    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        return arch_config(raw, architecture)  # with its sliding window, unlike Llama
