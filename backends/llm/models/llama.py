"""The Llama family (Llama, Mistral, Qwen2) in plain torch, reading K/V through paged attention.

Matches Hugging Face's modeling code numerically where it matters (RMSNorm in float32, RoPE
tables in float32, rotate-half layout, SiLU-gated MLP), with q/k/v and gate/up projections fused
into one matmul each. The forward takes the step's tokens flattened ([N]) with their positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import AttentionMetadata, Workspace, paged_attention, write_kv
from .loader import ModelConfig, iter_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies after the config's rope scaling, and the cos/sin scaling factor."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "dynamic":
        # vLLM's static form: the base grown for max_position_embeddings * factor.
        max_len = cfg.max_position_embeddings * factor
        base = base * ((factor * max_len / cfg.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / factor
    elif rope_type == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type not in ("default", "dynamic"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    return inv_freq, 1.0


@dataclass
class _Layer:
    """Projection weights are stored transposed, [in, out] (see `_proj`)."""

    input_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def _proj(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w_t (+ bias) with the weight stored [in, out]: MKL's plain layout. `F.linear` with the
    [out, in] weight runs 2-3x slower at 16-32 rows, a decode step's usual size (bench/llm_bench.py)."""
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, scale in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _interleave_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's output channels from rotate-half (x0..x31, x32..x63) to pairs (x0, x32, x1, x33, ..).

    q·k is unchanged when q and k are permuted alike, so attention is the same; RoPE becomes a
    complex multiply on adjacent pairs."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    shape = w.shape
    return w.view(heads, head_dim, *shape[1:])[:, perm].reshape(shape).contiguous()


class LlamaForCausalLM:
    """Weights + forward. Not an nn.Module: no autograd, no hooks, plain tensors."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.layers: list[_Layer] = []
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.scale = cfg.head_dim**-0.5
        self.workspace = Workspace()
        self.kernels: Any | None = None  # torch.ops.pier_llm once use_kernels() is called
        self.rope_table: torch.Tensor | None = None
        inv_freq, attn_scaling = rope_inv_freq(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        # RoPE as one complex multiply: q/k channels are stored interleaved (see _assign), so the
        # pair (x[i], x[i + half]) of HF's rotate-half layout is one complex number.
        cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        self.freqs_cis = torch.polar(torch.full_like(freqs, attn_scaling), freqs).to(device=device, dtype=cdtype)
        self.rope_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    @classmethod
    def load(cls, folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
             ) -> LlamaForCausalLM:
        """Load weights from the folder's safetensors. Raises ValueError on a missing tensor."""
        model = cls(cfg, dtype, device, max_positions)
        raw: dict[str, torch.Tensor] = {}
        for name, tensor in iter_weights(folder):
            if "rotary_emb" in name:
                continue
            raw[name] = tensor
        model._assign(raw)
        return model

    def _assign(self, raw: dict[str, torch.Tensor]) -> None:
        def take(name: str) -> torch.Tensor:
            if name not in raw:
                raise ValueError(f"weight {name} missing from the safetensors files")
            return raw.pop(name).to(device=self.device, dtype=self.dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in raw else None

        def cat_opt(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ValueError("projection biases present for some of q/k/v (or gate/up) only")
            return torch.cat([p for p in parts if p is not None]).contiguous()

        def t(w: torch.Tensor) -> torch.Tensor:
            return w.t().contiguous()

        cfg = self.cfg
        embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        head = maybe("lm_head.weight")
        self.embed = embed
        # An untied lm_head is stored [hidden, vocab] like the projections; a tied one stays the
        # embedding itself (one copy of the largest matrix; logits then use F.linear).
        self.lm_head = t(head) if head is not None else None
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            qb, kb = maybe(a + "q_proj.bias"), maybe(a + "k_proj.bias")
            self.layers.append(
                _Layer(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv_w=t(torch.cat([_interleave_rows(take(a + "q_proj.weight"), nh, hd),
                                       _interleave_rows(take(a + "k_proj.weight"), nkv, hd),
                                       take(a + "v_proj.weight")])),
                    qkv_b=cat_opt([None if qb is None else _interleave_rows(qb, nh, hd),
                                   None if kb is None else _interleave_rows(kb, nkv, hd), maybe(a + "v_proj.bias")]),
                    o_w=t(take(a + "o_proj.weight")),
                    o_b=maybe(a + "o_proj.bias"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up_w=t(torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])),
                    gate_up_b=cat_opt([maybe(m + "gate_proj.bias"), maybe(m + "up_proj.bias")]),
                    down_w=t(take(m + "down_proj.weight")),
                    down_b=maybe(m + "down_proj.bias"),
                )
            )

    def use_kernels(self, ops: Any) -> None:
        """Run RMSNorm, SiLU * up and RoPE + the K/V write through Pier's compiled ops (`kernels.py`;
        CPU float32, K cache block-transposed)."""
        self.kernels = ops
        self.rope_table = torch.view_as_real(self.freqs_cis).contiguous()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [N, hidden], for the step's flattened tokens."""
        assert self.embed is not None and self.norm is not None
        freqs = self.freqs_cis[positions].unsqueeze(1) if self.kernels is None else None  # [n, 1, hd/2]
        h = F.embedding(input_ids, self.embed)
        x = self._norm(h, self.layers[0].input_norm)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            qkv = _proj(x, layer.qkv_w, layer.qkv_b)
            q, k, v = self._rope_and_store(qkv, positions, freqs, k_cache, v_cache, meta)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.workspace)
            # Residual adds ride on the GEMM (h += attn @ W), then the next norm reads h.
            h.addmm_(attn, layer.o_w)
            if layer.o_b is not None:
                h.add_(layer.o_b)
            x = self._norm(h, layer.post_norm)
            x = self._silu_mul(_proj(x, layer.gate_up_w, layer.gate_up_b))
            h.addmm_(x, layer.down_w)
            if layer.down_b is not None:
                h.add_(layer.down_b)
            x = self._norm(h, self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm)
        return x

    def _rope_and_store(
        self, qkv: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor | None, k_cache: torch.Tensor,
        v_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v of the fused projection; k and v stored at their cache slots."""
        cfg = self.cfg
        n, hd, nh, nkv = qkv.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q_size, kv_size = nh * hd, nkv * hd
        v = qkv[:, q_size + kv_size :].view(n, nkv, hd)
        if self.kernels is not None:  # rotates q and k inside qkv, then stores k and v
            self.kernels.rope_write_kv(qkv, self.rope_table, positions, k_cache, v_cache, meta.slot_mapping, nh, nkv)
            return qkv[:, :q_size].view(n, nh, hd), qkv[:, q_size : q_size + kv_size].view(n, nkv, hd), v
        assert freqs is not None
        qk = qkv[:, : q_size + kv_size].view(n, nh + nkv, hd // 2, 2)
        if qk.dtype != self.rope_dtype:
            qk = qk.to(self.rope_dtype)
        qk = torch.view_as_real(torch.view_as_complex(qk) * freqs).view(n, nh + nkv, hd).to(self.dtype)
        q, k = qk[:, :nh], qk[:, nh:]
        write_kv(k_cache, v_cache, k, v, meta)
        return q, k, v

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            return rms_norm(x, weight, self.cfg.rms_norm_eps)
        out = torch.empty_like(x)
        self.kernels.rms_norm(out, x, weight, self.cfg.rms_norm_eps)
        return out

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        if self.kernels is None:
            return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
        self.kernels.silu_mul(out, gate_up)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [M, vocab] for the selected hidden rows."""
        if self.lm_head is None:
            assert self.embed is not None
            return F.linear(hidden, self.embed).float()
        return torch.mm(hidden, self.lm_head).float()
