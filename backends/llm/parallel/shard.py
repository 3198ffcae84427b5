"""Megatron's split of a decoder over `size` ranks, through the layers' own seams
(`Linear.shard`, `VocabEmbedding.shard`, the attention's heads):

- q/k/v and gate/up column-parallel (each rank its heads' rows, its share of the MLP's width), o and
  down row-parallel (one all-reduce each); a mixture of experts alike: every expert's width split,
  its gate/up and down as the dense MLP's, one all-reduce of the summed experts (the router whole);
- KV heads split across the ranks, or, with fewer KV heads than ranks, each rank holds the one its
  query heads read (replicated);
- the embedding and the LM head vocabulary-parallel.

`check` says, before anything starts, why a model does not split (heads or width not divisible, an
architecture whose layers are not split yet).
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers.linear import Linear, Split
from ..layers.vocab import VocabShard
from ..models.hf_config import ArchConfig
from .group import ParallelGroup

# the architectures whose layers are Llama's projections (models/llama.py's LlamaDecoderLayer), or
# those with a mixture of experts (models/mixtral.py's MoEDecoderLayer; Qwen2-MoE's shared expert too)
SPLITS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
          "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def check(cfg: ArchConfig, size: int) -> None:
    """ValueError saying why `cfg` does not split over `size` ranks."""
    if size == 1:
        return
    if cfg.architecture not in SPLITS:
        raise ValueError(f"tensor_parallel_size {size}: {cfg.architecture} is not split across ranks yet "
                         f"(tensor parallelism serves {', '.join(SPLITS)})")
    why = []
    if cfg.num_heads % size:
        why.append(f"its {cfg.num_heads} attention heads (num_attention_heads)")
    kv = cfg.num_kv_heads
    if (kv % size if kv >= size else size % kv):
        why.append(f"its {kv} KV heads (num_key_value_heads; with fewer KV heads than ranks, the ranks must "
                   "divide evenly among them)")
    if cfg.intermediate_size % size:
        why.append(f"its MLP width {cfg.intermediate_size} (intermediate_size)")
    for key, what in (("moe_intermediate_size", "its experts' width"),
                      ("shared_expert_intermediate_size", "its shared expert's width")):
        width = cfg.raw.get(key)
        if width and int(width) % size:
            why.append(f"{what} {width} ({key})")
    if why:
        raise ValueError(f"tensor_parallel_size {size} does not divide {' nor '.join(why)}: each rank must "
                         "hold whole heads and an equal share of the MLP")


def _partial(t: torch.Tensor) -> torch.Tensor:
    """A row-parallel product left as this rank's partial sum (FusedMoE's all-reduce adds it up)."""
    return t


def shard_model(model: Any, group: ParallelGroup) -> None:
    """Give each layer of `model` (built, not loaded yet) this rank's share; `check` passed."""
    cfg: ArchConfig = model.config
    r, n = group.rank, group.size
    nh, nkv, hd, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q_local = nh // n
    kv_local = max(nkv // n, 1)
    kv_first = r * nkv // n  # with fewer KV heads than ranks: the one this rank's query heads read
    i_local = inter // n
    for layer in model.layers:
        qkv: Linear = layer.qkv_proj
        kv = (kv_first * hd, kv_local * hd)
        qkv.shard(Split(((r * q_local * hd, q_local * hd), kv, kv), qkv.output_sizes))
        layer.gate_up_proj.shard(Split(((r * i_local, i_local),) * 2, layer.gate_up_proj.output_sizes))
        for row in (layer.o_proj, layer.down_proj):
            width = row.input_size // n
            row.shard(Split(((r * width, width),), (row.input_size,), group.all_reduce, group.first))
        moe = getattr(layer, "moe", None)
        if moe is not None:
            width = moe.inter // n
            moe.shard(r * width, width, group.all_reduce)
        shared = getattr(layer, "shared", None)  # Qwen2-MoE's shared expert: its partial sum joins the experts'
        if shared is not None:
            gate_up, down, _ = shared  # its sigmoid gate [hidden -> 1] stays whole: a factor per token
            width = down.input_size // n
            gate_up.shard(Split(((r * width, width),) * 2, gate_up.output_sizes))
            down.shard(Split(((r * width, width),), (down.input_size,), _partial, group.first))
        attn = layer.attn
        attn.num_heads, attn.num_kv_heads = q_local, kv_local
        attn.q_size, attn.kv_size = q_local * hd, kv_local * hd
    vocab = cfg.vocab_size
    padded = -(-vocab // n)
    start = min(r * padded, vocab)
    shard = VocabShard(start, min(padded, vocab - start), padded, vocab, group.all_reduce, group.all_gather)
    model.embed_tokens.shard(shard)
    head = model.lm_head.linear
    if head is not None:
        head.shard(Split(((shard.start, shard.length),), head.output_sizes))
