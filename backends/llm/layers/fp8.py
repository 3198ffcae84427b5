"""Products with FP8 (E4M3) checkpoint weights: `fp8_matmul`, called by `PackedLinearMethod` for a
`PackedWeight` with `fp8` set (layers/quantized.py; the checkpoint formats in models/quantization.py).

The weight is W[n, k] = e4m3(q[n, k]) * scales[n, k // group]: one scale per output row and input
group (a per-tensor scale and a 128 x 128 block's are repeated per row at load).
- CUDA with FP8 matrix cores (sm89+: Ada, Hopper, Blackwell) and one scale per row (per-tensor and
  per-channel checkpoints): W8A8, as vLLM runs them. The activations are quantized to E4M3 per token
  (dynamic: max |x| / 448 per row) or with the checkpoint's static `input_scale`, and multiplied by
  `torch._scaled_mm` with row-wise scales (out = (x_q @ q^T) * scale_x[m] * scale_w[n], in bfloat16).
  Whether the device runs it is probed once per device with a tiny product: a torch or driver that
  cannot is logged and falls back, never fails a request.
- Elsewhere (CPU, older GPUs, block-wise scales, widths that are not multiples of 16): weight-only, the
  weight de-quantized to the activations' dtype per call and multiplied in that dtype. The weight stays
  one byte per value in memory. On CPU with float32 activations this equals a float matmul on the
  de-quantized weights exactly (what the tests compare with transformers).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # the largest finite E4M3 (OCP "fn") value
_PROBED: dict[str, bool] = {}


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs FP8 operands with row-wise scales on `device` (probed once)."""
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _PROBED:
        ok = torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(torch, "_scaled_mm")
        if ok:
            try:
                a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
                torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                                 scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
            except (RuntimeError, NotImplementedError) as exc:
                log.warning("FP8 weights on %s: torch._scaled_mm with row-wise scales does not run (%s); the "
                            "weights are de-quantized per call instead", device, exc)
                ok = False
        _PROBED[key] = ok
    return _PROBED[key]


def uses_scaled_mm(q: torch.Tensor, group: int, device: torch.device) -> bool:
    """Whether a [N, K] FP8 weight (`q`, its bytes) in groups of `group` runs W8A8 on `device`."""
    n, k = q.shape
    return group == k and n % 16 == 0 and k % 16 == 0 and scaled_mm_supported(device)


def dequantize(q: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` (computed in float32, then rounded once)."""
    n, k = q.shape
    codes = q.view(torch.float8_e4m3fn).float().view(n, k // group, group)
    return (codes * scales[:, :, None]).view(n, k).to(dtype)


def fp8_matmul(q: torch.Tensor, scales: torch.Tensor, group: int, input_scale: torch.Tensor | None,
               x: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T for the FP8 weight held as `q` (uint8 view of E4M3 codes, [N, K]) and `scales`
    [N, K / group] float32; the result in x's dtype."""
    if not uses_scaled_mm(q, group, x.device):
        return torch.mm(x, dequantize(q, scales, group, x.dtype).t())
    if input_scale is not None:  # static: the checkpoint's per-tensor activation scale
        sx = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    else:  # dynamic, per token
        sx = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (x.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(xq, q.view(torch.float8_e4m3fn).t(), scale_a=sx, scale_b=scales.reshape(1, -1).contiguous(),
                           out_dtype=torch.bfloat16)
    return out.to(x.dtype)
