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


_GATED = {"silu": SiluAndMul}


def gated_activation(name: str) -> SiluAndMul:
    """The gated activation of config.json's `hidden_act`; ValueError for one not implemented."""
    try:
        return _GATED[name]()
    except KeyError:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {', '.join(_GATED)})") from None
