"""What the engine needs of a model: the `CausalLM` protocol (vLLM's model interface, in small).

A model class is built from its `ArchConfig` (`arch_config`, a classmethod: config.json read the way
that architecture reads it), then `load_weights` takes the checkpoint's tensors by name. Per step,
`forward` maps the step's flattened tokens (with their positions, the paged KV caches and the
attention metadata) to final hidden states, and `compute_logits` maps the rows that sample to float32
logits. `kv_cache_specs` says what one KV cache block holds per layer, so the runner allocates the
caches without knowing the architecture. `use_kernels` switches the layers to the compiled CPU ops.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..attention import AttentionMetadata
from .hf_config import ArchConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's K and V caches (layout: attention.py)


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's share of a KV cache block."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int = 0  # the layer's sliding window, 0 for full attention (its KV cache group: kv_groups.py)

    def bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * block_size * self.num_kv_heads * self.head_dim * elem


class CausalLM(Protocol):
    """A decoder-only language model over the paged KV cache."""

    config: ArchConfig
    dtype: torch.dtype
    device: torch.device
    kernels: Any | None  # torch.ops.pier_llm once use_kernels() was called

    @classmethod
    def arch_config(cls, raw: dict[str, Any], architecture: str) -> ArchConfig:
        """config.json (read_config's dict) as this architecture reads it; ValueError if it cannot."""
        ...

    def __init__(self, config: ArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the checkpoint's tensors; ValueError naming one missing or of the wrong shape."""
        ...

    def use_kernels(self, ops: Any) -> None:
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [N, hidden] of the step's N flattened tokens."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [M, vocab] of M hidden rows."""
        ...

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One entry per layer that keeps a KV cache, in layer order."""
        ...
