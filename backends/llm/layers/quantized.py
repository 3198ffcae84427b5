"""Weight-only quantized projections: `PackedWeight`, the one form every quantized format is brought to
at load, and `PackedLinearMethod`, the `LinearMethod` (layers/linear.py) that keeps and multiplies it.

W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g], g = k // group, with 4- or 8-bit values q: online
int8 (symmetric per output row: zeros 128 over q + 128), GPTQ, AWQ and compressed-tensors
(models/quantization.py unpacks each into this) all fit it; with `offset`, W[n, k] = q[n, k] *
scales[n, g] + zeros[n, g] (a float min, not an integer zero point: GGUF's Q4_1, Q5_1, Q4_K and
Q5_K, models/gguf_blocks.py; GGUF's 5- and 6-bit codes live in 8-bit containers). On CPU with float32 activations the
product reads the packed bytes directly (csrc/quant_linear.cpp: de-quantized in registers, each weight
computed as the formula reads, so the result equals a float matmul on the de-quantized weights up to
summation order), at every row count: de-quantize-then-matmul was slower from 1 to 512 rows, and
the fused kernel beats the float weight below about 16 rows, where decoding is bound by memory
(bench/results/quant_kernels.md). Elsewhere (CUDA, 16-bit activations, no compiler) the weight is
de-quantized per call in torch: correct, not fast.

FP8 checkpoints (`fp8`: E4M3 codes, W[n, k] = e4m3(q[n, k]) * scales[n, g], zeros 0) are held in the same
form, their block or per-tensor scales repeated per output row (so fused slices and RoPE's row order
keep working); layers/fp8.py multiplies them (torch._scaled_mm on CUDA sm89+, else de-quantized per call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import fp8 as fp8_ops


def _chunk_layout(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [N, K] (K % 32 == 0) -> [N, K / 2] bytes: byte j of each 32-value chunk holds
    value j in its low nibble and value 16 + j in its high one (what quant_linear.cpp reads)."""
    n, k = values.shape
    v = values.view(n, k // 32, 2, 16)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def _values(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_chunk_layout` for bits 4; the bytes themselves for 8."""
    if bits == 8:
        return q
    n, half = q.shape
    b = q.view(n, half // 16, 16)
    return torch.stack([b & 0xF, b >> 4], dim=2).reshape(n, half * 2)


@dataclass(frozen=True)
class PackedWeight:
    """A quantized [N, K] weight: `q` uint8 in the kernel's layout ([N, K] for 8 bits, [N, K / 2] for
    4), `scales` and `zeros` float32 [N, K / group]. `perm`: the input order the columns are stored
    in (GPTQ's act-order: stored column j is input column perm[j]), None for the natural order.
    `offset`: `zeros` holds mins added after the scaling (W = q * scales + zeros).
    `fp8`: q holds FP8 E4M3 codes ([N, K] bytes; zeros all 0); `input_scale`: a checkpoint's static
    activation scale (FP8 only; used where the activations are quantized too, layers/fp8.py)."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group: int
    input_size: int
    perm: torch.Tensor | None = None
    offset: bool = False
    fp8: bool = False
    input_scale: torch.Tensor | None = None

    @classmethod
    def from_values(cls, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
                    perm: torch.Tensor | None = None, offset: bool = False) -> PackedWeight:
        """From unpacked values [N, K] (0 .. 2^bits - 1, any integer dtype), scales and zeros [N, K / group]."""
        n, k = values.shape
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit weights are not supported (4 or 8)")
        step = 32 if bits == 4 else 16
        if k % group or group % step:
            raise ValueError(f"input width {k} and group size {group} must be multiples of {step} for "
                             f"{bits}-bit weights (and the group must divide the width)")
        if tuple(scales.shape) != (n, k // group) or tuple(zeros.shape) != (n, k // group):
            raise ValueError(f"scales/zeros of shape {list(scales.shape)}/{list(zeros.shape)}, expected "
                             f"{[n, k // group]}")
        v = values.to(torch.uint8)
        return cls(v.contiguous() if bits == 8 else _chunk_layout(v), scales.float().contiguous(),
                   zeros.float().contiguous(), bits, group, k, perm, offset)

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, scales: torch.Tensor, group: int,
                 input_scale: torch.Tensor | None = None) -> PackedWeight:
        """From an FP8 E4M3 weight [N, K] and its scales per output row and input group [N, K / group]."""
        n, k = weight.shape
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight has dtype {weight.dtype}, expected torch.float8_e4m3fn")
        if k % group or tuple(scales.shape) != (n, k // group):
            raise ValueError(f"scales of shape {list(scales.shape)} do not fit a [{n}, {k}] weight in groups of "
                             f"{group}")
        return cls(weight.contiguous().view(torch.uint8), scales.float().contiguous(), torch.zeros(n, k // group), 8,
                   group, k, fp8=True, input_scale=None if input_scale is None else input_scale.float().reshape(()))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.input_size)

    def to(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> PackedWeight:
        """On `device` (the dtype stays: the scales are float32 whatever the model's dtype)."""
        if device is None:
            return self
        return replace(self, q=self.q.to(device), scales=self.scales.to(device), zeros=self.zeros.to(device),
                       perm=None if self.perm is None else self.perm.to(device),
                       input_scale=None if self.input_scale is None else self.input_scale.to(device))

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedWeight:
        """The same weight with its output rows reordered or selected by `fn` (a row-wise function
        of a [N, ...] tensor, such as RoPE's pair layout)."""
        return replace(self, q=fn(self.q), scales=fn(self.scales), zeros=fn(self.zeros))

    def rows(self, start: int, length: int) -> PackedWeight:
        """Output rows [start, start + length) (a column-parallel rank's share, a fused projection's
        slice), copied: the whole weight is not kept alive."""
        return self.map_rows(lambda t: t.narrow(0, start, length).clone())

    def columns(self, start: int, length: int) -> PackedWeight:
        """Input columns [start, start + length) (a row-parallel rank's share): whole groups of them, and
        whole 32-code chunks of 4-bit codes; a weight with one group per row keeps its scales. ValueError
        for a split inside a group or an act-order weight (its stored columns are not the inputs' order)."""
        if self.perm is not None:
            raise ValueError("an act-order (desc_act / g_idx) weight stores its input columns out of order, so "
                             "no rank holds a contiguous share of them")
        whole = self.group >= self.input_size  # one scale per row: every share of the row keeps it
        unit = max(32 if self.bits == 4 else 1, 1 if whole else self.group)
        if start % unit or length % unit:
            raise ValueError(f"input columns {start}..{start + length} of {self.input_size} split a group of "
                             f"{self.group} {self.bits}-bit weights (each rank must hold whole groups)")
        per_byte = 2 if self.bits == 4 and not self.fp8 else 1
        q = self.q[:, start // per_byte:(start + length) // per_byte].contiguous()
        if whole:
            return replace(self, q=q, group=length, input_size=length)
        g = slice(start // self.group, (start + length) // self.group)
        return replace(self, q=q, scales=self.scales[:, g].contiguous(), zeros=self.zeros[:, g].contiguous(),
                       input_size=length)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] in the natural input order."""
        if self.fp8:
            return fp8_ops.dequantize(self.q, self.scales, self.group, dtype)
        w = _weights(self, torch.float32)
        if self.perm is not None:
            natural = torch.empty_like(w)
            natural[:, self.perm] = w
            w = natural
        return w.to(dtype)

    @staticmethod
    def join(parts: Sequence[PackedWeight | torch.Tensor]) -> PackedWeight | PackedSlices | torch.Tensor:
        """Output slices stacked (q, k, v or gate, up). Where they disagree on bits, group, form or input
        order (a GGUF file's q/k in Q4_K beside v in Q6_K), each stays packed as it came and is
        multiplied on its own (`PackedSlices`); a float slice among packed ones makes the whole the
        de-quantized float weight (still correct; the method stores it as floats)."""
        first = parts[0]
        if any(isinstance(p, torch.Tensor) for p in parts):
            return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(p.scales.dtype) for p in parts])
        packed = [p for p in parts if isinstance(p, PackedWeight)]
        assert isinstance(first, PackedWeight) and len(packed) == len(parts)
        if len(parts) == 1:
            return first
        same = all(p.bits == first.bits and p.group == first.group and p.offset == first.offset and
                   p.fp8 == first.fp8 and
                   ((p.perm is None and first.perm is None) or
                    (p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm)))
                   for p in packed)
        if not same:
            return PackedSlices(tuple(packed))
        inputs = [p.input_scale for p in packed if p.input_scale is not None]  # one for the fused input: vLLM's max
        return replace(first, q=torch.cat([p.q for p in packed]), scales=torch.cat([p.scales for p in packed]),
                       zeros=torch.cat([p.zeros for p in packed]),
                       input_scale=torch.stack(inputs).amax() if len(inputs) == len(packed) else None)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + self.zeros.nbytes


@dataclass(frozen=True)
class PackedSlices:
    """Output slices packed differently (see `PackedWeight.join`): the product is each slice's, side by side."""

    parts: tuple[PackedWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].input_size)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """Online weight-only int8 (issue 34's scheme): per output row, scale = max |w| / 127, q = round(w /
    scale) clamped to +-127. Stored as q + 128 over zeros of 128 (one unsigned form for every format).
    A row of zeros keeps scale 0 (q 0)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.clamp(torch.round(w / torch.where(scale == 0, 1.0, scale)[:, None]), -127, 127)
    n, k = w.shape
    return PackedWeight.from_values((q + 128).to(torch.uint8), scale[:, None], torch.full((n, 1), 128.0), 8, k)


def dequantize_int8_reference(weight: torch.Tensor) -> torch.Tensor:
    """What `quantize_int8` stores, as floats: the weights a reference model runs (tests, benchmarks)."""
    return quantize_int8(weight).dequantize(weight.dtype)


class PackedLinearMethod:
    """Keeps a `PackedWeight` and multiplies by it. `online`: a float checkpoint weight is quantized
    to int8 here (`quantization: "int8"`); otherwise a float weight (a layer the checkpoint left
    unquantized) is kept as floats and multiplied as such."""

    accepts_packed = True

    def __init__(self, online: bool, ops: Any | None) -> None:
        self.online = online
        self.ops = ops  # torch.ops.pier_llm (quant_linear), or None: torch only
        self.float_weight: torch.Tensor | None = None  # [in, out], for a layer left in float

    def process(self, layer: Any, weight: Any) -> None:
        if isinstance(weight, torch.Tensor) and self.online:
            weight = quantize_int8(weight)
        if isinstance(weight, torch.Tensor):
            self.float_weight = weight.to(layer.dtype).t().contiguous()
            layer.weight = None
            return
        layer.weight = weight  # type: ignore[assignment]  # the method's stored form

    def packed(self, layer: Any) -> PackedWeight | PackedSlices | None:
        w = layer.weight
        return w if isinstance(w, PackedWeight | PackedSlices) else None

    def apply(self, layer: Any, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        p = self.packed(layer)
        if p is None:
            assert self.float_weight is not None, f"{layer.name}: not loaded"
            out = torch.mm(x, self.float_weight)
        elif isinstance(p, PackedSlices):
            out = torch.cat([self._product(part, x) for part in p.parts], dim=1)
        else:
            out = self._product(p, x)
        if layer.bias is not None:
            out.add_(layer.bias)
        if residual is not None:
            return residual.add_(out)
        return out

    def _product(self, p: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(p, x if p.perm is None else x.index_select(1, p.perm))

    def _matmul(self, p: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        if p.fp8:
            return fp8_ops.fp8_matmul(p.q, p.scales, p.group, p.input_scale, x)
        if self.ops is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            out = torch.empty((x.shape[0], p.q.shape[0]), dtype=torch.float32)
            self.ops.quant_linear(out, x.contiguous(), p.q, p.scales, p.zeros, p.bits, p.group, p.offset)
            return out
        return torch.mm(x, _weights(p, x.dtype).t())


def _weights(p: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [N, K] in stored column order, computed as the kernel computes it (in `dtype`)."""
    idx = torch.arange(p.input_size, device=p.q.device) // p.group
    q, s, z = _values(p.q, p.bits).to(dtype), p.scales[:, idx].to(dtype), p.zeros[:, idx].to(dtype)
    return q * s + z if p.offset else (q - z) * s
