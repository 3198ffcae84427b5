"""LoRA deltas on a `Linear`: the batched shrink/expand (Punica's SGMV idea) behind `LinearMethod`.

`LoRALinearMethod` wraps a layer's own method (unquantized, oneDNN, a quantized one: any) and adds,
after the layer's product, each adapter's low-rank delta to the rows of the step that run that
adapter: for the rows R of adapter s, y[R] += (x[R] @ A_s) @ B_s. A fused projection (q/k/v,
gate/up) holds one A and one B per adapter: A_s = [A_q | A_k | A_v] ([in, r_q + r_k + r_v]) and B_s
block-diagonal ([r_q + r_k + r_v, out]) with the scaling (alpha / r, or alpha / sqrt(r) for rsLoRA)
folded in, so each adapter costs one shrink and one expand GEMM per projection, whatever its slices.
Rows of the base model (no adapter) are left as the layer computed them; a step with no adapter
rows costs nothing beyond the base product.

`LoRABatch` is the step's row mapping, one object shared by every wrapped layer of a model: the
model runner sets it before the forward (`set`), from each scheduled sequence's adapter id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .linear import Linear, LinearMethod


@dataclass
class LoRABatch:
    """The step's rows per adapter id: (id, row indices) for each adapter in the step (never id 0,
    the base model). `whole`: the one adapter every row of the step runs (no indexing needed)."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    whole: int = 0

    def set(self, row_ids: list[int], device: torch.device) -> None:
        """Map rows to adapters from each row's adapter id (0: the base model)."""
        self.groups, self.whole = [], 0
        distinct = set(row_ids)
        if distinct == {0} or not row_ids:
            return
        if len(distinct) == 1:
            self.whole = row_ids[0]
            return
        for lid in sorted(distinct - {0}):
            rows = [i for i, r in enumerate(row_ids) if r == lid]
            self.groups.append((lid, torch.tensor(rows, device=device)))

    def clear(self) -> None:
        self.groups, self.whole = [], 0


class LoRALinearMethod:
    """A layer's method plus the deltas of the adapters loaded for it (`weights`: id -> (A, B),
    A [in, R], B [R, out] with the scaling folded into B)."""

    def __init__(self, base: LinearMethod, batch: LoRABatch) -> None:
        self.base = base
        self.batch = batch
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def process(self, layer: Linear, weight: torch.Tensor) -> None:
        self.base.process(layer, weight)

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, residual)
        batch = self.batch
        if batch.whole:
            ab = self.weights.get(batch.whole)
            if ab is not None:
                y.addmm_(torch.mm(x, ab[0]), ab[1])
            return y
        for lid, rows in batch.groups:
            ab = self.weights.get(lid)
            if ab is not None:
                y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), ab[0]), ab[1]))
        return y
