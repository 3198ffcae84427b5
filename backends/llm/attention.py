"""Paged attention, reference torch version: K/V live in fixed-size blocks, read through block tables.

Cache layout, per layer: `[num_kv_heads, num_blocks, block_size, head_dim]` for K and for V
(head-major, so that a gathered sequence is contiguous per head, which SDPA reads fastest); with
the compiled kernel, K is block-transposed instead, `[num_kv_heads, num_blocks, head_dim,
block_size]`. A token's slot is `block_id * block_size + offset`.

The flattened batch of one step is ordered: decode tokens first (one per sequence, grouped by
context length so that padding stays small), then prefill chunks (several tokens per sequence).
Each layer first writes every new token's K/V into its slot, then attends. On CPU in float32 the
decode tokens, and each token of a prefill chunk of up to 64 tokens as a query of its own over its
context (model_runner._KERNEL_PREFILL), go to the compiled kernel (`csrc/paged_attention.cpp`),
which reads each sequence's blocks in place; elsewhere (CUDA, other dtypes, no compiler) a decode
group gathers its sequences' blocks into a reused workspace (one `index_select`, no allocation) and
runs one batched SDPA. Another prefill chunk without a cached prefix attends over its own new K/V
(causal), and one with a prefix (prefix cache hit, or a later chunk of a chunked prefill) gathers
its blocks and uses a causal mask shifted by the prefix length.

An FP8 cache (kv_fp8.py) holds K / k_scale and V / v_scale in float8 tensors (the layer's
`LayerKV.scales`): `write_kv` quantizes, the gathers decode after `index_select`, and the compiled
kernel reads the FP8 blocks itself. A prefill chunk without a cached prefix attends over its own new
K/V rounded through FP8 as the cache holds them, so that every path (and the kernel, which reads
short prefills from the cache) sees the same values.

Two options of a layer's attention (`paged_attention`'s `window` and `softcap`): a sliding window
(a query attends to the last `window` positions only, itself included, as transformers' masks) and
Gemma 2's soft-capped scores (cap * tanh(s / cap) before the mask and the softmax; SDPA has no such
step, so a capped layer's torch path computes the scores itself, as transformers' eager attention).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_fp8 import KVScales, dequantize, quantize


class LayerKV(tuple[torch.Tensor, torch.Tensor]):
    """One layer's (k_cache, v_cache), unpacked as the pair; `scales` are the FP8 cache's K/V
    scales (None: the cache is in the model's dtype); `group` the layer's KV cache group
    (kv_groups.py), whose block tables its attention reads. The runner builds these; models pass them on."""

    scales: KVScales | None
    group: int

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, scales: KVScales | None = None, group: int = 0) -> LayerKV:
        self = super().__new__(cls, (k, v))
        self.scales = scales
        self.group = group
        return self


@dataclass
class DecodeGroup:
    """`num_seqs` decode tokens at rows [start, start + num_seqs) of the batch."""

    start: int
    num_seqs: int
    num_blocks: int  # blocks per sequence after padding
    block_ids: torch.Tensor  # [num_seqs * num_blocks] long; padding rows point at block 0
    mask: torch.Tensor | None  # [num_seqs, 1, 1, num_blocks * block_size] bool, True = attend; None: all full
    context_lens: torch.Tensor | None = None  # [num_seqs] long (a sliding window's mask starts from them)


@dataclass
class DecodeBatch:
    """All decode tokens, rows [0, num_seqs), for the compiled kernel (`kernels.py`): no gather, no padding."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    op: Callable[..., None]


@dataclass
class PrefillChunk:
    """One sequence's chunk at rows [start, start + num_tokens); `num_cached` tokens precede it."""

    start: int
    num_tokens: int
    num_cached: int
    block_ids: torch.Tensor | None  # [num_blocks] long when num_cached > 0
    mask: torch.Tensor | None  # [num_tokens, num_cached + num_tokens] bool when num_cached > 0


@dataclass
class AttentionMetadata:
    """Per-step facts shared by every layer (built once by the model runner)."""

    slot_mapping: torch.Tensor  # [num_tokens] long
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decode: DecodeBatch | None = None  # replaces decode_groups when the compiled kernel is in use
    prefills: list[PrefillChunk] = field(default_factory=list)
    # K stored block-transposed, [kv_heads, num_blocks, head_dim, block_size]: the compiled
    # kernels' layout, whose fused RoPE op also writes K (so `write_kv` never sees this layout).
    k_transposed: bool = False
    # with several KV cache groups (kv_groups.py), each group's metadata (this one the first's): a
    # layer uses that of its `LayerKV.group`
    groups: list[AttentionMetadata] = field(default_factory=list)


class Workspace:
    """Reusable gather buffers: allocating fresh multi-MB tensors every layer costs page faults."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, slot: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        key = (slot, like.dtype, like.device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, int(numel * 1.25)), dtype=like.dtype, device=like.device)
            self._bufs[key] = buf
        return buf[:numel].view(shape)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    scales: KVScales | None = None,
) -> None:
    """Store the new tokens' K/V ([N, kv_heads, head_dim]) into their slots (torch path's layout);
    with `scales`, quantized into the FP8 cache (the clamped values counted in `scales.clamped`)."""
    assert not meta.k_transposed, "the block-transposed K cache is written by the fused RoPE op"
    kvh, hd = v_cache.shape[0], v_cache.shape[3]
    if scales is not None:  # index_copy_ has no float8 kernel: the bytes go through a uint8 view
        (k, ck), (v, cv) = quantize(k, scales.k, k_cache.dtype), quantize(v, scales.v, v_cache.dtype)
        scales.clamped += ck + cv
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache.view(kvh, -1, hd).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.view(kvh, -1, hd).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    workspace: Workspace,
    window: int = 0,
    softcap: float = 0.0,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Attention for a whole step. q: [N, heads, hd]; k, v: [N, kv_heads, hd] (new tokens only).

    Returns [N, heads * hd]. The caller has already stored k, v in the cache (`write_kv`, or the
    fused RoPE + write op), so a sequence may read blocks another sequence of the same step
    writes (a prefix-cache hit on blocks computed this step). `window` > 0: each query sees the
    last `window` positions only; `softcap` > 0: scores capped at +-softcap (tanh); `scales`: the
    caches are FP8 (kv_fp8.py).
    """
    n, heads, hd = q.shape
    kvh = k.shape[1]
    group = heads // kvh
    bs = v_cache.shape[2]
    outs: list[torch.Tensor] = []
    if meta.decode is not None:
        d = meta.decode
        o = torch.empty(d.num_seqs, heads * hd, dtype=q.dtype, device=q.device)
        if scales is not None:
            d.op(o, q[: d.num_seqs], k_cache, v_cache, d.block_tables, d.context_lens, scale, softcap, window,
                 scales.k, scales.v)
        elif window or softcap:
            d.op(o, q[: d.num_seqs], k_cache, v_cache, d.block_tables, d.context_lens, scale, softcap, window)
        else:
            d.op(o, q[: d.num_seqs], k_cache, v_cache, d.block_tables, d.context_lens, scale)
        outs.append(o)
    for g in meta.decode_groups:
        b, nb = g.num_seqs, g.num_blocks
        kb, vb = _gather(k_cache, v_cache, g.block_ids, q, workspace, scales)
        keys = kb.view(kvh, b, nb * bs, hd).transpose(0, 1)
        values = vb.view(kvh, b, nb * bs, hd).transpose(0, 1)
        mask = g.mask
        if window:
            assert g.context_lens is not None
            cols = torch.arange(nb * bs, device=q.device).unsqueeze(0)
            lens = g.context_lens.unsqueeze(1)
            mask = ((cols < lens) & (cols >= lens - window)).view(b, 1, 1, -1)
        # One query token per sequence: the `group` query heads sharing a KV head become rows.
        qg = q[g.start : g.start + b].view(b, kvh, group, hd)
        o = attend(qg, keys, values, mask, scale, softcap)
        outs.append(o.reshape(b, heads * hd))
    for p in meta.prefills:
        qs = q[p.start : p.start + p.num_tokens].transpose(0, 1).unsqueeze(0)
        mask = p.mask
        if window:
            mask = prefix_causal_mask(p.num_cached, p.num_tokens, q.device, window)
        if p.num_cached == 0:
            keys = k[p.start : p.start + p.num_tokens].transpose(0, 1).unsqueeze(0)
            values = v[p.start : p.start + p.num_tokens].transpose(0, 1).unsqueeze(0)
            if scales is not None:  # K/V as the FP8 cache holds them, as every other read (the kernel's too)
                keys = dequantize(quantize(keys, scales.k, k_cache.dtype)[0], scales.k, q.dtype)
                values = dequantize(quantize(values, scales.v, v_cache.dtype)[0], scales.v, q.dtype)
        else:
            assert p.block_ids is not None
            ctx = p.num_cached + p.num_tokens
            nb = p.block_ids.numel()
            kb, vb = _gather(k_cache, v_cache, p.block_ids, q, workspace, scales)
            if meta.k_transposed:
                kb = kb.transpose(2, 3)
            keys = kb.reshape(kvh, nb * bs, hd)[:, :ctx].unsqueeze(0)
            values = vb.view(kvh, nb * bs, hd)[:, :ctx].unsqueeze(0)
        o = attend(qs, keys, values, mask, scale, softcap, causal=mask is None)
        outs.append(o.squeeze(0).transpose(0, 1).reshape(p.num_tokens, heads * hd))
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs, dim=0)


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, q: torch.Tensor,
            workspace: Workspace, scales: KVScales | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks `block_ids` of both caches, [kv_heads, len(block_ids), ...] in q's dtype."""
    shape_k = (k_cache.shape[0], block_ids.numel(), *k_cache.shape[2:])
    shape_v = (v_cache.shape[0], block_ids.numel(), *v_cache.shape[2:])
    if scales is None:
        kb, vb = workspace.get(0, shape_k, q), workspace.get(1, shape_v, q)
        torch.index_select(k_cache, 1, block_ids, out=kb)
        torch.index_select(v_cache, 1, block_ids, out=vb)
        return kb, vb
    kb, vb = workspace.get(2, shape_k, k_cache), workspace.get(3, shape_v, v_cache)
    torch.index_select(k_cache, 1, block_ids, out=kb)
    torch.index_select(v_cache, 1, block_ids, out=vb)
    return dequantize(kb, scales.k, q.dtype), dequantize(vb, scales.v, q.dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float = 0.0, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale [capped], masked) v for q [B, H, L, hd], keys and values [B, KVH, S, hd]
    (H a multiple of KVH); `mask` bool, True = attend, broadcast to [B, H, L, S]; `causal` when no mask."""
    group = q.shape[1] // keys.shape[1]
    if not softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=group > 1)
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    s = torch.matmul(q, keys.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        mask = prefix_causal_mask(s.shape[-1] - s.shape[-2], s.shape[-2], q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), values)


def prefix_causal_mask(num_cached: int, num_tokens: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """[num_tokens, num_cached + num_tokens] bool: query i sees keys 0 .. num_cached + i (with a
    `window`, only the last `window` of them)."""
    cols = torch.arange(num_cached + num_tokens, device=device).unsqueeze(0)
    rows = torch.arange(num_tokens, device=device).unsqueeze(1) + num_cached
    if window:
        return (cols <= rows) & (cols > rows - window)
    return cols <= rows
