"""`FusedMoE`: a mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing, then each expert's gated
MLP over the tokens routed to it.

The experts' weights are stacked ([experts, hidden, 2 * inter] for gate and up, [experts, inter,
hidden] for down; transposed for `mm`, as `Linear` keeps its own). The (token, choice) pairs are
sorted by expert once, so each expert runs one matrix product over all of its tokens (a grouped
computation, never a loop over tokens); the weighted outputs are summed expert by expert, in expert
order, then added into the residual stream, as transformers sums them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .activation import SiluAndMul


class FusedMoE:
    """`num_experts` SiLU-gated experts of width `inter`, `top_k` of them per token; `renormalize`: the
    chosen experts' softmax weights are divided by their sum (Mixtral; Qwen3-MoE's `norm_topk_prob`)."""

    def __init__(self, name: str, num_experts: int, top_k: int, hidden: int, inter: int, renormalize: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.name, self.num_experts, self.top_k, self.renormalize = name, num_experts, top_k, renormalize
        self.hidden, self.inter = hidden, inter
        self.dtype, self.device = dtype, device
        self.act = SiluAndMul()
        self.w13: torch.Tensor | None = None  # [E, hidden, 2 * inter]
        self.w2: torch.Tensor | None = None  # [E, inter, hidden]
        self._parts: dict[tuple[int, int], torch.Tensor] = {}
        self.share: tuple[int, int] | None = None  # (start, length) of each expert's width this rank holds
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def shard(self, start: int, length: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Hold only channels [start, start + length) of every expert's width (tensor parallelism, before
        `load`): gate and up column-parallel, down row-parallel; the ranks' partial sums are all-reduced
        (the router stays whole on every rank, so each routes alike)."""
        self.share, self.all_reduce = (start, length), all_reduce

    def load(self, expert: int, part: int, weight: torch.Tensor) -> None:
        """One expert's checkpoint tensor: part 0 gate [inter, hidden], 1 up [inter, hidden], 2 down [hidden, inter]."""
        expected = (self.hidden, self.inter) if part == 2 else (self.inter, self.hidden)
        if tuple(weight.shape) != expected:
            raise ValueError(f"{self.name}: expert {expert} {('gate', 'up', 'down')[part]} weight has shape "
                             f"{list(weight.shape)}, expected {list(expected)}")
        if self.share is not None:
            weight = weight.narrow(1 if part == 2 else 0, *self.share).clone()
        self._parts[(expert, part)] = weight.to(device=self.device, dtype=self.dtype)

    def finish(self) -> None:
        """Stack the loaded experts (every part of every expert is in: the weight map checked it)."""
        e = range(self.num_experts)
        self.w13 = torch.stack([torch.cat([self._parts[(i, 0)], self._parts[(i, 1)]]).t() for i in e]).contiguous()
        self.w2 = torch.stack([self._parts[(i, 2)].t() for i in e]).contiguous()
        self._parts.clear()

    def use_kernels(self, ops: object) -> None:
        self.act.use_kernels(ops)

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, residual: torch.Tensor,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
        """Add the experts' weighted outputs for x [N, hidden] (and `shared`, a shared expert's gated
        output, Qwen2-MoE's; sharded, this rank's partial sum of it) into `residual` (in place) and return it."""
        assert self.w13 is not None and self.w2 is not None, f"{self.name}: not loaded"
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        picked = x[tokens]
        scale = weights.flatten()[order].unsqueeze(1)
        total = torch.zeros_like(residual)  # summed apart first, then added: transformers' order of sums
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            out = torch.mm(self.act(torch.mm(picked[rows], self.w13[e])), self.w2[e])
            total.index_add_(0, tokens[rows], (out * scale[rows]).to(total.dtype))
            start += count
        if shared is not None:  # a rank's share of it with tensor parallelism, summed with the experts'
            total.add_(shared)
        if self.all_reduce is not None:  # each rank summed its share of every expert's width
            total = self.all_reduce(total)
        return residual.add_(total)
