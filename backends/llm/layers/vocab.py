"""The token embedding and the LM head (tied to the embedding, or a matrix of its own)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import Linear, UnquantizedLinearMethod, default_method


class VocabEmbedding:
    """[vocab, hidden] rows looked up by token id."""

    def __init__(self, name: str, vocab_size: int, hidden_size: int) -> None:
        self.name, self.shape = name, (vocab_size, hidden_size)
        self.weight: torch.Tensor | None = None

    def load(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"{self.name}: weight has shape {list(weight.shape)}, expected {list(self.shape)}")
        self.weight = weight.to(device=device, dtype=dtype).contiguous()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        return F.embedding(ids, self.weight)


class LMHead:
    """Float32 logits [M, vocab] for hidden rows: through its own `Linear`, or, tied (`linear` None),
    through the embedding matrix itself (one copy of the largest matrix; F.linear reads it [vocab, hidden])."""

    def __init__(self, embedding: VocabEmbedding, linear: Linear | None) -> None:
        self.embedding, self.linear = embedding, linear

    def tie(self, dtype: torch.dtype, device: torch.device) -> None:
        """Once the embedding is loaded, for a tied head: where the default linear method keeps a
        weight in a layout of its own (oneDNN's, on CPU), the head gets a `Linear` loaded from the
        embedding. A second copy of the largest matrix (vocab x hidden), for an LM head 1.9x as fast
        (bench/results/llm_profile.md); elsewhere F.linear reads the embedding itself."""
        if self.linear is not None or isinstance(default_method(dtype, device), UnquantizedLinearMethod):
            return
        assert self.embedding.weight is not None
        vocab, hidden = self.embedding.shape
        self.linear = Linear("lm_head (tied to model.embed_tokens)", hidden, (vocab,), False, dtype, device)
        self.linear.load(0, self.embedding.weight)
        self.linear.finish()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.linear is None:
            assert self.embedding.weight is not None
            return F.linear(hidden, self.embedding.weight).float()
        return self.linear(hidden).float()
