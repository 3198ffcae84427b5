"""`Attention`: one decoder layer's attention over the paged KV cache, from its fused q/k/v projection.

RoPE on q and k, the new tokens' K/V written to their cache slots, then paged attention (the step's
decode tokens and prefill chunks; `backends/llm/attention.py` is the paged attention itself and the
per-step metadata). With the compiled CPU kernels (`use_kernels`), RoPE and the K/V write are one op
and the K cache is block-transposed (the decode kernel's layout). With an FP8 cache, a layer whose
scales are not known yet (none in the checkpoint) derives them from the first prefill it sees.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import AttentionMetadata, Workspace, paged_attention, write_kv
from .norm import RMSNorm
from .rotary import RotaryEmbedding


class Attention:
    """Heads, KV heads and head size of one layer; `scale` is the softmax scale (head_dim ** -0.5 by
    default), `window` > 0 a sliding window, `softcap` > 0 Gemma 2's score cap (attention.py);
    `qk_norm`, the per-head RMSNorms of q and of k before RoPE (Qwen3, Gemma 3), their weights in
    the rotary pair layout as the q and k rows are."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rope: RotaryEmbedding,
                 workspace: Workspace, scale: float | None = None, window: int = 0, softcap: float = 0.0,
                 qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.rope = rope
        self.workspace = workspace
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window, self.softcap = window, softcap
        self.qk_norm = qk_norm
        self.kernels: Any | None = None

    def use_kernels(self, ops: Any) -> None:
        self.kernels = ops

    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor, rotations: torch.Tensor | None,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """[N, heads * head_dim] for the step's tokens; `rotations` is `rope.at(positions)` (None with kernels)."""
        k_cache, v_cache = kv_cache
        scales = getattr(kv_cache, "scales", None)  # an FP8 cache's (attention.LayerKV)
        group = getattr(kv_cache, "group", 0)  # its KV cache group's block tables (kv_groups.py)
        if group:
            meta = meta.groups[group]
        n, hd, nh, nkv = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qs, kvs = self.q_size, self.kv_size
        v = qkv[:, qs + kvs :].view(n, nkv, hd)
        if self.qk_norm is not None:
            q_norm, k_norm = self.qk_norm
            qkv[:, :qs] = q_norm(qkv[:, :qs].reshape(n * nh, hd)).view(n, qs)
            qkv[:, qs : qs + kvs] = k_norm(qkv[:, qs : qs + kvs].reshape(n * nkv, hd)).view(n, kvs)
        if self.kernels is not None:  # rotates q and k inside qkv, then stores k and v
            assert self.rope.table is not None
            if scales is None:
                self.kernels.rope_write_kv(qkv, self.rope.table, positions, k_cache, v_cache, meta.slot_mapping, nh,
                                           nkv)
            else:
                if not scales.ready:  # RoPE turns channel pairs: a pair's norm bounds both after it
                    pairs = qkv[:, qs : qs + kvs].reshape(n, nkv * hd // 2, 2)
                    scales.derive(float(pairs.norm(dim=-1).max()), float(v.abs().max()), k_cache.dtype)
                scales.clamped += self.kernels.rope_write_kv(qkv, self.rope.table, positions, k_cache, v_cache,
                                                             meta.slot_mapping, nh, nkv, scales.k, scales.v)
            q, k = qkv[:, :qs].view(n, nh, hd), qkv[:, qs : qs + kvs].view(n, nkv, hd)
        else:
            assert rotations is not None
            qk = self.rope.rotate(qkv[:, : qs + kvs].view(n, nh + nkv, hd), rotations)
            q, k = qk[:, :nh], qk[:, nh:]
            if scales is not None and not scales.ready:
                scales.derive(float(k.abs().max()), float(v.abs().max()), k_cache.dtype)
            write_kv(k_cache, v_cache, k, v, meta, scales)
        return paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.workspace, self.window, self.softcap,
                               scales)
