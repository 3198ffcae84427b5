"""Qwen3-MoE: Qwen3's attention (q/k norms) with Mixtral's kind of MoE MLP, on the layers the config
makes sparse (not in `mlp_only_layers`, and every `decoder_sparse_step`-th; the others keep a dense
MLP of `intermediate_size`): `num_experts` experts of width `moe_intermediate_size`, the chosen
ones' weights renormalised only with `norm_topk_prob`; checkpoint names `mlp.gate` and
`mlp.experts.{e}.gate_proj/up_proj/down_proj`."""

from __future__ import annotations

from typing import Any

from .hf_config import ArchConfig, arch_config
from .llama import LlamaDecoderLayer
from .mixtral import MixtralForCausalLM, MoEDecoderLayer
from .qwen2 import qwen_windows
from .qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(MoEDecoderLayer, Qwen3DecoderLayer):
    moe_prefix = "mlp."
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @staticmethod
    def moe_settings(cfg: ArchConfig, layer: int) -> tuple[int, int, int, bool] | None:
        raw = cfg.raw
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)  # 4.x, 5.x names
        step = int(raw.get("decoder_sparse_step") or 1)
        if experts == 0 or layer in (raw.get("mlp_only_layers") or []) or (layer + 1) % step:
            return None
        return experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]), \
            bool(raw.get("norm_topk_prob", False))


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    layer_class: type[LlamaDecoderLayer] = Qwen3MoeDecoderLayer

    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        return qwen_windows(raw, arch_config(raw, architecture))
