"""Gated activations: act(gate) * up over a fused [gate | up] projection's output."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class SiluAndMul:
    """silu(x[:, :d]) * x[:, d:] (Llama's MLP), through the compiled CPU kernel where it is in use."""

    def __init__(self) -> None:
        self.kernels: Any | None = None

    def use_kernels(self, ops: Any) -> None:
        self.kernels = ops

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        if self.kernels is None:
            return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
        self.kernels.silu_mul(out, gate_up)
        return out


class GeluTanhAndMul(SiluAndMul):
    """gelu_tanh(x[:, :d]) * x[:, d:] (Gemma's GeGLU, `gelu_pytorch_tanh`): torch's own op, no kernel."""

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        return F.gelu(gate_up[:, :inter], approximate="tanh").mul_(gate_up[:, inter:])


_GATED = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def gated_activation(name: str) -> SiluAndMul:
    """The gated activation of config.json's `hidden_act`; ValueError for one not implemented."""
    try:
        return _GATED[name]()
    except KeyError:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {', '.join(_GATED)})") from None
