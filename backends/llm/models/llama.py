"""Llama in plain torch, composed of `layers/`: the template the other decoders here extend.

Matches Hugging Face's modeling code numerically where it matters (RMSNorm in float32, RoPE tables
in float32, SiLU-gated MLP), with q/k/v and gate/up projections fused into one `Linear` each (q and
k rows stored in RoPE's pair layout, layers/rotary.py). The forward takes the step's tokens
flattened ([N]) with their positions; the o and down projections add into the residual stream
(their GEMM's post-op: layers/linear.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from ..attention import AttentionMetadata, Workspace
from ..layers.activation import gated_activation
from ..layers.attention import Attention
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.vocab import LMHead, VocabEmbedding
from .hf_config import ArchConfig, arch_config
from .interface import KVCache, KVCacheSpec
from .loader import WeightMap


def layer_index(prefix: str) -> int:
    """The layer number of a decoder layer's tensor-name prefix, "model.layers.{i}."."""
    return int(prefix.rstrip(".").rsplit(".", 1)[1])


class LlamaDecoderLayer:
    """Pre-norm attention and gated MLP, each added into the residual stream."""

    def __init__(self, cfg: ArchConfig, prefix: str, rope: RotaryEmbedding, workspace: Workspace,
                 dtype: torch.dtype, device: torch.device) -> None:
        nh, nkv, hd, hidden, inter = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                                      cfg.intermediate_size)
        self.rope, self.qk_heads = rope, (nh, nkv)
        self.input_layernorm = RMSNorm(prefix + "input_layernorm", hidden, cfg.rms_norm_eps)
        self.qkv_proj = Linear(prefix + "self_attn.qkv_proj", hidden, (nh * hd, nkv * hd, nkv * hd), cfg.qkv_bias,
                               dtype, device)
        self.attn = Attention(nh, nkv, hd, rope, workspace, window=cfg.window(layer_index(prefix)))
        self.o_proj = Linear(prefix + "self_attn.o_proj", nh * hd, (hidden,), cfg.o_bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(prefix + "post_attention_layernorm", hidden, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(prefix + "mlp.gate_up_proj", hidden, (inter, inter), cfg.mlp_bias, dtype, device)
        self.act = gated_activation(cfg.hidden_act)
        self.down_proj = Linear(prefix + "mlp.down_proj", inter, (hidden,), cfg.mlp_bias, dtype, device)
        self.linears: tuple[Linear, ...] = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        self.norms: tuple[RMSNorm, ...] = (self.input_layernorm, self.post_attention_layernorm)

    def checkpoint_parts(self, prefix: str) -> list[tuple[Linear, tuple[str, ...]]]:
        """Each projection with the checkpoint's names of its slices, in order."""
        a, m = prefix + "self_attn.", prefix + "mlp."
        return [(self.qkv_proj, (a + "q_proj", a + "k_proj", a + "v_proj")), (self.o_proj, (a + "o_proj",)),
                (self.gate_up_proj, (m + "gate_proj", m + "up_proj")), (self.down_proj, (m + "down_proj",))]

    def slice_layout(self, linear: Linear, index: int, rows: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor whose rows are slice `index`'s outputs (its weight or bias, a LoRA B)
        in the order this layer stores them: q's and k's in RoPE's pair layout."""
        if linear is self.qkv_proj and index < 2:
            return self.rope.interleave(rows, self.qk_heads[index])
        return rows

    def weights(self, prefix: str, rope: RotaryEmbedding, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                into: WeightMap) -> None:
        """Map Hugging Face's tensor names (separate q/k/v, gate/up) onto the fused projections."""
        for norm in self.norms:
            into.add(f"{norm.name}.weight", norm.loader(dtype, device))
        for linear, parts in self.checkpoint_parts(prefix):
            for i, part in enumerate(parts):
                kinds = ("weight", "bias") if linear.has_bias else ("weight",)
                for kind in kinds:
                    def load(t: torch.Tensor, lin: Linear = linear, i: int = i, kind: str = kind) -> None:
                        lin.load(i, self.slice_layout(lin, i, t), kind)
                    into.add(f"{part}.{kind}", load)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, rotations: torch.Tensor | None, kv_cache: KVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream `h` with this layer's attention and MLP outputs added (in place where
        the linear method adds in place: use the returned tensor)."""
        x = self.input_layernorm(h)
        h = self.o_proj(self.attn(self.qkv_proj(x), positions, rotations, kv_cache, meta), residual=h)
        x = self.post_attention_layernorm(h)
        return self.down_proj(self.act(self.gate_up_proj(x)), residual=h)


class LlamaForCausalLM:
    """Weights + forward (`interface.CausalLM`). Not an nn.Module: no autograd, no hooks, plain tensors."""

    layer_class = LlamaDecoderLayer

    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        return replace(arch_config(raw, architecture), sliding_window=None)  # Llama has no sliding window

    def __init__(self, config: ArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        self.config = cfg = config
        self.dtype, self.device = dtype, device
        self.kernels: Any | None = None
        self.workspace = Workspace()
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings, max_positions, dtype, device)
        self.embed_tokens = VocabEmbedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size)
        self.layers = [self.layer_class(cfg, f"model.layers.{i}.", self.layer_rope(i), self.workspace, dtype, device)
                       for i in range(cfg.num_layers)]
        self.norm = RMSNorm("model.norm", cfg.hidden_size, cfg.rms_norm_eps)
        head = None if cfg.tie_word_embeddings else Linear("lm_head", cfg.hidden_size, (cfg.vocab_size,), False,
                                                              dtype, device)
        self.lm_head = LMHead(self.embed_tokens, head)

    def layer_rope(self, layer: int) -> RotaryEmbedding:
        """The RoPE of layer `layer` (one for all here; Gemma 3's local layers have their own)."""
        return self.rope

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg, dtype, device = self.config, self.dtype, self.device
        into = WeightMap()
        into.add("model.embed_tokens.weight", lambda t: self.embed_tokens.load(t, dtype, device))
        into.add("model.norm.weight", self.norm.loader(dtype, device))
        head = self.lm_head.linear
        if head is not None:  # a checkpoint without it ties the head to the embedding after all
            into.add("lm_head.weight", lambda t: head.load(0, t), optional=True)
        for i, layer in enumerate(self.layers):
            layer.weights(f"model.layers.{i}.", self.rope, cfg, dtype, device, into)
        loaded = into.load(weights)
        if head is not None and "lm_head.weight" not in loaded:
            self.lm_head.linear = None
        for linear in [*(lin for layer in self.layers for lin in layer.linears), *filter(None, [self.lm_head.linear])]:
            linear.finish()
        self.lm_head.tie(dtype, device)

    def use_kernels(self, ops: Any) -> None:
        """Run RMSNorm, SiLU * up and RoPE + the K/V write through Pier's compiled ops (`kernels.py`;
        CPU float32, K cache block-transposed)."""
        self.kernels = ops
        self.rope.use_kernels()
        self.norm.use_kernels(ops)
        for layer in self.layers:
            for norm in layer.norms:
                norm.use_kernels(ops)
            layer.act.use_kernels(ops)
            layer.attn.use_kernels(ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        rotations = self.rope.at(positions) if self.kernels is None else None  # once for every layer
        h = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, positions, rotations, kv_cache, meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Each layer's attention's KV heads: a tensor-parallel rank's share of them (parallel/shard.py)."""
        return [KVCacheSpec(layer.attn.num_kv_heads, layer.attn.head_dim, self.dtype, layer.attn.window)
                for layer in self.layers]
