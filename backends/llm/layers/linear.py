"""`Linear`: a projection that owns its weight, and `LinearMethod`: how that weight is stored and applied.

Every projection of a decoder (the fused q/k/v, o, the fused gate/up, down) is a `Linear`, so there is
one place where the way a weight is held and multiplied can change: a quantization method is a
`LinearMethod` (vLLM's `QuantizeMethodBase`: `process` turns the checkpoint's float tensor into the
stored form, `apply` multiplies by it), and a LoRA adapter wraps the layer's method with one that adds
its low-rank delta (`x @ A @ B`, per output slice: `output_sizes` names the q/k/v or gate/up widths).
Tensor parallelism will shard in `load` (column- or row-wise by output or input).
"""

from __future__ import annotations

from typing import Protocol

import torch


class LinearMethod(Protocol):
    """How a `Linear` keeps and applies its weight."""

    def process(self, layer: Linear, weight: torch.Tensor) -> None:
        """Store `weight` ([out, in], the checkpoint's layout, in the model dtype) in this method's form."""

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias); with `residual`, added into it in place and returned."""


class UnquantizedLinearMethod:
    """The weight in the model dtype, stored transposed ([in, out]): MKL's plain layout. `F.linear`
    with the [out, in] weight runs 2-3x slower at 16-32 rows, a decode step's usual size
    (bench/llm_bench.py). A residual add rides on the GEMM (h += x @ W)."""

    def process(self, layer: Linear, weight: torch.Tensor) -> None:
        layer.weight = weight.t().contiguous()

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        w, b = layer.weight, layer.bias
        assert w is not None, f"{layer.name}: not loaded"
        if residual is not None:
            residual.addmm_(x, w)
            return residual if b is None else residual.add_(b)
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


class Linear:
    """y = x @ W^T + b for W of shape [sum(output_sizes), input_size].

    Fused projections load one part per output slice (`load(index, weight)`: q, k, v or gate, up)
    and are joined by `finish()`, which hands the whole weight to the method. `__call__(x, residual)`
    adds into `residual` in place when given (the decoder's residual stream)."""

    def __init__(self, name: str, input_size: int, output_sizes: tuple[int, ...], bias: bool,
                 dtype: torch.dtype, device: torch.device, method: LinearMethod | None = None) -> None:
        self.name = name
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.has_bias = bias
        self.dtype, self.device = dtype, device
        self.method: LinearMethod = method or UnquantizedLinearMethod()
        self.weight: torch.Tensor | None = None  # the method's stored form
        self.bias: torch.Tensor | None = None
        self._parts: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)

    def load(self, index: int, weight: torch.Tensor, kind: str = "weight") -> None:
        """Keep one output slice's checkpoint tensor (`kind` "weight" [out_i, in] or "bias" [out_i])."""
        expected = (self.output_sizes[index], self.input_size) if kind == "weight" else (self.output_sizes[index],)
        if tuple(weight.shape) != expected:
            raise ValueError(f"{self.name}: {kind} of slice {index} has shape {list(weight.shape)}, "
                             f"expected {list(expected)}")
        self._parts[(kind, index)] = weight.to(device=self.device, dtype=self.dtype)

    def missing(self) -> list[tuple[str, int]]:
        """The (kind, slice) parts not loaded yet."""
        kinds = ("weight", "bias") if self.has_bias else ("weight",)
        return [(k, i) for k in kinds for i in range(len(self.output_sizes)) if (k, i) not in self._parts]

    def finish(self) -> None:
        """Join the loaded slices and store them (the method's `process`). Call once every part is in."""
        assert not self.missing(), f"{self.name}: parts missing {self.missing()}"
        n = len(self.output_sizes)
        weight = torch.cat([self._parts[("weight", i)] for i in range(n)]) if n > 1 else self._parts[("weight", 0)]
        if self.has_bias:
            self.bias = torch.cat([self._parts[("bias", i)] for i in range(n)]).contiguous()
        self._parts.clear()
        self.method.process(self, weight.contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.method.apply(self, x, residual)
