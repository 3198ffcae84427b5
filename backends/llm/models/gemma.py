"""Gemma 2 and Gemma 3 (text): Llama's projections with Gemma's numerics.

- RMSNorm as (1 + w) (`layers.norm.GemmaRMSNorm`), four per layer: the attention and MLP outputs are
  normed (`post_attention_layernorm`, `post_feedforward_layernorm`) before they join the residual
  stream, and the MLP input has its own (`pre_feedforward_layernorm`);
- GeGLU (`hidden_activation`, gelu with the tanh approximation), embeddings scaled by sqrt(hidden),
  the LM head tied to the embedding;
- softmax scale query_pre_attn_scalar ** -0.5; scores soft-capped at `attn_logit_softcapping` and
  logits at `final_logit_softcapping` (Gemma 2; Gemma 3's configs leave them off);
- sliding-window and global layers alternating (`layer_types`; from a transformers 4.x config.json,
  Gemma 2's every other layer, Gemma 3's `sliding_window_pattern`);
- Gemma 3 adds a (1 + w) RMSNorm over each head of q and k, and its local (sliding) layers rotate with
  their own RoPE base (`rope_parameters["sliding_attention"]`, 4.x's `rope_local_base_freq`),
  unscaled, while the scaling kind applies to the global layers only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import torch

from ..attention import AttentionMetadata, Workspace
from ..layers.activation import gated_activation
from ..layers.attention import Attention
from ..layers.norm import GemmaRMSNorm, RMSNorm
from ..layers.rotary import RotaryEmbedding
from .hf_config import ArchConfig, arch_config
from .interface import KVCache
from .llama import LlamaDecoderLayer, LlamaForCausalLM, layer_index
from .loader import WeightMap


class Gemma2DecoderLayer(LlamaDecoderLayer):
    qk_norm = False

    def __init__(self, cfg: ArchConfig, prefix: str, rope: RotaryEmbedding, workspace: Workspace,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, prefix, rope, workspace, dtype, device)
        hidden, eps, raw = cfg.hidden_size, cfg.rms_norm_eps, cfg.raw
        self.input_layernorm = GemmaRMSNorm(prefix + "input_layernorm", hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(prefix + "post_attention_layernorm", hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(prefix + "pre_feedforward_layernorm", hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(prefix + "post_feedforward_layernorm", hidden, eps)
        self.norms = (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                      self.post_feedforward_layernorm)
        qk_norm = None
        if self.qk_norm:
            qk_norm = (GemmaRMSNorm(prefix + "self_attn.q_norm", cfg.head_dim, eps),
                       GemmaRMSNorm(prefix + "self_attn.k_norm", cfg.head_dim, eps))
            self.norms = (*self.norms, *qk_norm)
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rope, workspace,
                              scale=float(raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5,
                              window=cfg.window(layer_index(prefix)),
                              softcap=float(raw.get("attn_logit_softcapping") or 0.0), qk_norm=qk_norm)
        self.act = gated_activation(cfg.hidden_act)

    def weights(self, prefix: str, rope: RotaryEmbedding, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                into: WeightMap) -> None:
        super().weights(prefix, rope, cfg, dtype, device, into)
        for norm in self.attn.qk_norm or ():  # in the pair layout of the q and k rows
            def load(t: torch.Tensor, norm: RMSNorm = norm) -> None:
                norm.load(rope.interleave(t, 1), dtype, device)
            into.add(f"{norm.name}.weight", load)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, rotations: torch.Tensor | None,  # type: ignore[override]
                 kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after this layer (a new tensor): each block's output is normed first."""
        x = self.input_layernorm(h)
        h = h + self.post_attention_layernorm(self.o_proj(self.attn(self.qkv_proj(x), positions, rotations, kv_cache,
                                                                    meta)))
        x = self.pre_feedforward_layernorm(h)
        return h + self.post_feedforward_layernorm(self.down_proj(self.act(self.gate_up_proj(x))))


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    qk_norm = True


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_class: type[LlamaDecoderLayer] = Gemma2DecoderLayer
    sliding_pattern = 2  # 4.x configs: layer i slides when (i + 1) % pattern != 0

    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        cfg = arch_config(raw, architecture)
        pattern = int(raw.get("sliding_window_pattern") or cls.sliding_pattern)
        types = cfg.layer_types or tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                         for i in range(cfg.num_layers))
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        return replace(cfg, hidden_act=str(act), tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
                       mlp_bias=False, layer_types=types)

    def __init__(self, config: ArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        self.local_rope = self._local_rope(config, dtype, device, max_positions)
        super().__init__(config, dtype, device, max_positions)
        self.norm = GemmaRMSNorm("model.norm", config.hidden_size, config.rms_norm_eps)
        self.normalizer = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
        self.final_softcap = float(config.raw.get("final_logit_softcapping") or 0.0)

    def _local_rope(self, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                    max_positions: int) -> RotaryEmbedding | None:
        return None

    def layer_rope(self, layer: int) -> RotaryEmbedding:
        return self.local_rope if self.local_rope is not None and self.config.window(layer) else self.rope

    def use_kernels(self, ops: Any) -> None:
        super().use_kernels(ops)
        if self.local_rope is not None:
            self.local_rope.use_kernels()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        rotations: dict[int, torch.Tensor | None] = {}
        for rope in filter(None, (self.rope, self.local_rope)):  # once per RoPE for every layer
            rotations[id(rope)] = rope.at(positions) if self.kernels is None else None
        h = self.embed_tokens(input_ids) * self.normalizer
        for layer, kv_cache in zip(cast("list[Gemma2DecoderLayer]", self.layers), kv_caches):
            h = layer(h, positions, rotations[id(layer.attn.rope)], kv_cache, meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3DecoderLayer
    sliding_pattern = 6

    def _local_rope(self, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                    max_positions: int) -> RotaryEmbedding | None:
        params = cfg.raw.get("rope_parameters") or {}
        local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else None
        rope = {"rope_type": "default", "rope_theta": float(cfg.raw.get("rope_local_base_freq", 10000.0)),
                **(local or {})}
        return RotaryEmbedding(cfg.head_dim, rope, cfg.max_position_embeddings, max_positions, dtype, device)
