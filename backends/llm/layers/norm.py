"""RMSNorm as Hugging Face computes it, with the compiled CPU kernel where it is in use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, scale in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm:
    """y = w * x / rms(x). `kernels` (torch.ops.pier_llm, CPU float32) runs it in one pass."""

    def __init__(self, name: str, size: int, eps: float) -> None:
        self.name, self.size, self.eps = name, size, eps
        self.weight: torch.Tensor | None = None
        self.kernels: Any | None = None

    def load(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        if tuple(weight.shape) != (self.size,):
            raise ValueError(f"{self.name}: weight has shape {list(weight.shape)}, expected [{self.size}]")
        self.weight = weight.to(device=device, dtype=dtype).contiguous()

    def loader(self, dtype: torch.dtype, device: torch.device) -> Callable[[torch.Tensor], None]:
        return lambda weight: self.load(weight, dtype, device)

    def use_kernels(self, ops: Any) -> None:
        self.kernels = ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        if self.kernels is None:
            return rms_norm(x, self.weight, self.eps)
        out = torch.empty_like(x)
        self.kernels.rms_norm(out, x, self.weight, self.eps)
        return out


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, y = (1 + w) * x / rms(x): the checkpoint's w is stored as 1 + w (in float32
    first, as Gemma computes it), so the forward is RMSNorm's."""

    def load(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        super().load(1.0 + weight.float(), dtype, device)
