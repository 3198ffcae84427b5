"""The FP8 KV cache (vLLM's kv_cache_dtype `fp8` = `fp8_e4m3`, and `fp8_e5m2`): formats, per-layer
scales, and the torch path's quantize and read.

A layer's K and V caches hold x / k_scale and x / v_scale (one scalar each per layer, per-tensor as
vLLM's), clamped to the format's range (E4M3FN +-448, E5M2 +-57344); reading multiplies back. The
scales come from the checkpoint where it has them (`...self_attn.k_scale` / `.v_scale` and the other
names vLLM remaps, `checkpoint_kv_scales`); where it does not, vLLM silently uses 1.0 (garbage for
a model whose K outgrows the format), and Pier derives them from the first prefill each layer sees:
the largest |value| times `HEADROOM`, over the format's max. The headroom is almost free: FP8 is a
floating-point format, so its relative precision is the same across its range, and only values
below max / (HEADROOM * 2**dynamic range) lose bits; it keeps a short first prompt from making later
values clamp. Values that clamp anyway are counted (`KVScales.clamped`, the engine's stats).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HEADROOM = 4.0


def cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The cache tensors' dtype for vLLM's setting; None for `auto` (the model's dtype)."""
    return FP8_DTYPES.get(kv_cache_dtype)


@dataclass
class KVScales:
    """One layer's K and V scales (dequantized value = stored * scale) and how they were found."""

    k: float = 1.0
    v: float = 1.0
    source: str = ""  # "checkpoint", "derived", or "" until the first prefill derives them
    clamped: int = 0  # values clamped to the format's range when stored

    @property
    def ready(self) -> bool:
        return bool(self.source)

    def derive(self, k_amax: float, v_amax: float, dtype: torch.dtype) -> None:
        """Set both scales from the first prefill's largest |K| and |V| (see the module's doc)."""
        if not (k_amax > 0.0 and v_amax > 0.0 and k_amax < float("inf") and v_amax < float("inf")):
            return  # nothing to measure (all zeros, or not finite): 1.0 stays until a prefill that has
        fmax = torch.finfo(dtype).max
        self.k = k_amax * HEADROOM / fmax
        self.v = v_amax * HEADROOM / fmax
        self.source = "derived"


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """x / scale in `dtype`, clamped to its range (NaN stored as 0); and how many values clamped.
    The same bits as the compiled write (csrc/pier_fp8.h)."""
    fmax = torch.finfo(dtype).max
    y = x.float() / scale
    over = int((~(y.abs() <= fmax)).sum())
    if over:
        y = torch.nan_to_num(y, nan=0.0, posinf=fmax, neginf=-fmax).clamp_(-fmax, fmax)
    return y.to(dtype), over


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return stored.to(dtype).mul_(scale)


# vLLM's checkpoint names for a layer's KV scales (maybe_remap_kv_scale_name): self_attn.k_scale,
# the ModelOpt k_proj.k_scale, fused qkv_proj.k_scale, attn.k_scale, output_scale of k_proj/v_proj,
# and the deprecated single kv_scale for both.
_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj|qkv_proj|attn)\.)?"
                         r"(k_scale|v_scale|kv_scale)$")
_OUTPUT_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$")


def checkpoint_kv_scales(weights: Iterable[tuple[str, torch.Tensor]], found: dict[int, dict[str, float]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the checkpoint's tensors through, noting each layer's K/V scales in `found`
    ({layer: {"k": .., "v": ..}}); the model's loader leaves these names alone."""
    for name, tensor in weights:
        m = _SCALE_NAME.match(name)
        o = None if m else _OUTPUT_SCALE.match(name)
        if m or o:
            if m:
                layer, which = int(m.group(1)), ("k", "v") if m.group(2) == "kv_scale" else (m.group(2)[0],)
            else:
                assert o is not None
                layer, which = int(o.group(1)), (o.group(2),)
            if tensor.numel() != 1:
                raise ValueError(f"{name}: a KV cache scale must be one value per layer (per-tensor), "
                                 f"got shape {list(tensor.shape)}")
            value = float(tensor.float().reshape(()))
            if not value > 0.0:
                raise ValueError(f"{name}: a KV cache scale must be positive, got {value}")
            for w in which:
                found.setdefault(layer, {})[w] = value
        yield name, tensor


def layer_scales(num_layers: int, found: dict[int, dict[str, float]]) -> list[KVScales]:
    """One KVScales per cache layer: the checkpoint's where it has both, else to be derived."""
    extra = sorted(set(found) - set(range(num_layers)))
    if extra:
        raise ValueError(f"KV cache scale for layer {extra[0]}, but the model has {num_layers} cache layers")
    out = []
    for i in range(num_layers):
        f = found.get(i, {})
        if "k" in f and "v" in f:
            out.append(KVScales(f["k"], f["v"], "checkpoint"))
        else:
            out.append(KVScales())
    return out
