"""The token embedding and the LM head (tied to the embedding, or a matrix of its own).

Vocabulary-parallel under tensor parallelism (`VocabEmbedding.shard`): each rank holds the rows of
one contiguous range of token ids (`VocabShard`); the embedding looks up the ids in its range (zero
rows for the others) and the ranks' rows are summed by one all-reduce; the LM head computes the
logits of its range and the ranks' ranges are gathered into the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import Linear, UnquantizedLinearMethod, default_method


@dataclass(frozen=True)
class VocabShard:
    """Token ids [start, start + length) of a `full` vocabulary; every rank's range is `padded` long
    but the last rank's (the gathered logits are cut back to `full`)."""

    start: int
    length: int
    padded: int
    full: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    all_gather: Callable[[torch.Tensor], torch.Tensor]  # [M, padded] per rank -> [M, ranks * padded]


class VocabEmbedding:
    """[vocab, hidden] rows looked up by token id."""

    def __init__(self, name: str, vocab_size: int, hidden_size: int) -> None:
        self.name, self.shape = name, (vocab_size, hidden_size)
        self.weight: torch.Tensor | None = None
        self.vocab_shard: VocabShard | None = None

    def shard(self, shard: VocabShard) -> None:
        """Hold only the rows of `shard`'s range (before `load`)."""
        self.vocab_shard = shard
        self.shape = (shard.length, self.shape[1])

    def load(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        vs = self.vocab_shard
        expected = self.shape if vs is None else (vs.full, self.shape[1])
        if tuple(weight.shape) != expected:
            raise ValueError(f"{self.name}: weight has shape {list(weight.shape)}, expected {list(expected)}")
        if vs is not None:
            weight = weight.narrow(0, vs.start, vs.length).clone()
        self.weight = weight.to(device=device, dtype=dtype).contiguous()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        vs = self.vocab_shard
        if vs is None:
            return F.embedding(ids, self.weight)
        local = ids - vs.start
        outside = (local < 0) | (local >= vs.length)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return vs.all_reduce(rows.masked_fill_(outside.unsqueeze(1), 0.0))


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
            logits = F.linear(hidden, self.embedding.weight).float()
        else:
            logits = self.linear(hidden).float()
        vs = self.embedding.vocab_shard
        if vs is None:
            return logits
        if vs.length < vs.padded:
            logits = F.pad(logits, (0, vs.padded - vs.length))
        return vs.all_gather(logits)[:, : vs.full]
