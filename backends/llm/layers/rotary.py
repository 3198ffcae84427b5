"""Rotary position embedding (RoPE) with the scaling kinds real checkpoints use.

The inverse frequencies follow Hugging Face's `modeling_rope_utils` for each `rope_type`: `default`,
`linear` (positions divided by `factor`), `dynamic` (NTK: the base grown for the longer context; vLLM's
static form, sized once for max_position_embeddings * factor), `llama3` (Llama 3.1's smooth
low/high-frequency split), `yarn` (NTK-by-parts with its attention factor on cos/sin) and `longrope`
(Phi-3's per-frequency short and long factors: positions before `original_max_position_embeddings`
rotate with the short ones, later positions with the long ones, so a sequence that grows past it
gets what transformers computes step by step; a prompt longer than that is rotated with the long
factors throughout by transformers, and here only from that position on). Parameters
come normalised from models/hf_config.py (config.json of transformers 4.x, `rope_theta` +
`rope_scaling`, or 5.x, `rope_parameters`).

Layout: RoPE is one complex multiply on adjacent channel pairs. Hugging Face rotates halves (x[i]
with x[i + d/2]); the q and k projection rows are permuted at load (`interleave_rows`) so that those
pairs sit side by side. q·k is unchanged when q and k are permuted alike, so attention is the same.
With `partial_rotary_factor` < 1 only the first channels of a head rotate: the others keep their
order, and their pairs get the rotation 1 + 0i (an exact identity), so the kernels see a full table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_dim(head_dim: int, rope: Mapping[str, Any]) -> int:
    """The channels of a head that rotate (`partial_rotary_factor` of them)."""
    return int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))


def rope_inv_freq(head_dim: int, rope: Mapping[str, Any], max_position_embeddings: int,
                  long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies after the scaling, and the factor applied to cos and sin (`long`: LongRoPE's
    long factors)."""
    kind = rope.get("rope_type", "default")
    base = float(rope.get("rope_theta", 10000.0))
    dim = rotary_dim(head_dim, rope)
    factor = float(rope.get("factor") or 1.0)
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    if kind == "dynamic":
        max_len = max_position_embeddings * factor
        base = base * ((factor * max_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if kind == "linear":
        return inv_freq / factor, 1.0
    original = float(rope.get("original_max_position_embeddings") or max_position_embeddings)
    if kind == "longrope":
        if rope.get("factor") is None:
            factor = max_position_embeddings / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base**exponents), float(attention)
    if kind == "llama3":
        low = float(rope.get("low_freq_factor", 1.0))
        high = float(rope.get("high_freq_factor", 4.0))
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        if rope.get("factor") is None:
            factor = max_position_embeddings / original
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                         if mscale and mscale_all_dim else _yarn_mscale(factor))
        fast, slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(fast), correction_dim(slow)
        if rope.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        extrapolate = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
        return inv_freq, float(attention)
    return inv_freq, 1.0


def interleave_rows(w: torch.Tensor, heads: int, head_dim: int, rotary: int | None = None) -> torch.Tensor:
    """Reorder each head's output channels from rotate-half (x0..x31, x32..x63) to pairs (x0, x32, x1, x33, ..);
    with `rotary` < head_dim, only the first `rotary` channels (the rest keep their places)."""
    half = (rotary or head_dim) // 2
    perm = torch.cat([torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten(),
                      torch.arange(2 * half, head_dim)])
    shape = w.shape
    return w.view(heads, head_dim, *shape[1:])[:, perm].reshape(shape).contiguous()


class RotaryEmbedding:
    """cos/sin (as complex numbers) for positions 0 .. max_positions - 1 of one head size."""

    def __init__(self, head_dim: int, rope: Mapping[str, Any], max_position_embeddings: int, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, rope)
        inv_freq, attention_factor = rope_inv_freq(head_dim, rope, max_position_embeddings)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        if rope.get("rope_type") == "longrope":  # the long factors from original_max_position_embeddings on
            original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
            long_freq, _ = rope_inv_freq(head_dim, rope, max_position_embeddings, long=True)
            freqs[original:] = torch.outer(torch.arange(original, max(max_positions, original), dtype=torch.float32),
                                           long_freq)[: max(max_positions - original, 0)]
        cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        cis = torch.polar(torch.full_like(freqs, attention_factor), freqs)
        if self.rotary_dim < head_dim:  # the channels that do not rotate: 1 + 0i
            cis = torch.cat([cis, torch.ones(max_positions, (head_dim - self.rotary_dim) // 2, dtype=cis.dtype)], dim=1)
        self.freqs_cis = cis.to(device=device, dtype=cdtype)
        self.compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.table: torch.Tensor | None = None  # [positions, hd/2, 2] for the compiled kernel

    def use_kernels(self) -> None:
        self.table = torch.view_as_real(self.freqs_cis).contiguous()

    def interleave(self, w: Any, heads: int) -> Any:
        """A q or k projection's rows (weight or bias, float or a quantized `PackedWeight`) in the pair
        layout this embedding rotates."""
        if not isinstance(w, torch.Tensor):  # PackedWeight: its q, scales and zeros rows alike
            return w.map_rows(lambda t: interleave_rows(t, heads, self.head_dim, self.rotary_dim))
        return interleave_rows(w, heads, self.head_dim, self.rotary_dim)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotations of a step's positions, [n, 1, hd/2] (computed once, used by every layer)."""
        return self.freqs_cis[positions].unsqueeze(1)

    def rotate(self, qk: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """q and k heads side by side, [n, heads, hd], rotated by `at(positions)` (a new tensor)."""
        n, heads, hd = qk.shape
        pairs = qk.view(n, heads, hd // 2, 2)
        if pairs.dtype != self.compute_dtype:
            pairs = pairs.to(self.compute_dtype)
        rotated = torch.view_as_complex(pairs) * rotations
        return torch.view_as_real(rotated).view(n, heads, hd).to(qk.dtype)
