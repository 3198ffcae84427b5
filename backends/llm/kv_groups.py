"""KV cache groups (vLLM's hybrid KV cache manager): a model's layers grouped by attention kind, each
group with a block table of its own per sequence, all groups' blocks from one pool.

A full-attention group keeps every block of a sequence; a sliding-window group (window W: a query at
position p sees p - W + 1 .. p, itself included, as transformers' and attention.py's masks) gives back
the blocks wholly before the window of the next token to compute (kv_cache.py), so a long sequence
holds about W / block_size + 1 of them. For those blocks to serve any group, the groups have the same
number of layers (vLLM's uniform page size): layer j of every group stores its K/V in the runner's
cache tensor pair ("slot") j, so one block id is `slots` layers' worth of memory wherever it goes.
A kind with more layers than the group size is split into several groups of that kind (their tables
hold the same number of blocks), the last one padded (its missing layers' slots unused). A model whose
layers are all one kind, or whose layers' KV shapes differ, is one group of every layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .models.interface import KVCacheSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """`window` 0: full attention; `layers`: indexes into the model's `kv_cache_specs`, the j-th of
    which stores its K/V in slot j."""

    window: int
    layers: tuple[int, ...]


def group_layers(specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """The model's layers in groups of one attention kind each: full attention first, then by window."""
    kinds: dict[int, list[int]] = {}
    for i, spec in enumerate(specs):
        kinds.setdefault(spec.window, []).append(i)
    if len(kinds) == 1 or len({dataclasses.replace(s, window=0) for s in specs}) > 1:
        return [KVCacheGroup(specs[0].window if len(kinds) == 1 else 0, tuple(range(len(specs))))]
    sizes = [len(v) for v in kinds.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)  # vLLM's rule: little padding, few groups
    return [KVCacheGroup(w, tuple(kinds[w][i : i + size]))
            for w in sorted(kinds) for i in range(0, len(kinds[w]), size)]


def max_seq_tokens(windows: Sequence[int], num_blocks: int, block_size: int, chunk: int) -> int | None:
    """The longest sequence that fits in `num_blocks` alone (None: any, when no group attends to
    everything): a full-attention group holds each of its blocks, a sliding one at most those of its
    window, the block being written and a prefill chunk's (`chunk` tokens); at least the tokens that
    fit with every group holding every block."""
    floor = num_blocks // len(windows) * block_size
    full = sum(1 for w in windows if not w)
    room = num_blocks - sum((w - 1) // block_size + 2 + -(-chunk // block_size) for w in windows if w)
    if room < 0:
        return floor
    return None if not full else max(floor, room // full * block_size)


def num_slots(groups: Sequence[KVCacheGroup]) -> int:
    """Cache tensor pairs the groups' layers share: the largest group's layer count."""
    return max(len(g.layers) for g in groups)


def group_of(groups: list[KVCacheGroup], window: int) -> int:
    """The first group of attention kind `window` (a draft model's layer), appended (with no layers of
    the served model) when there is none."""
    for i, g in enumerate(groups):
        if g.window == window:
            return i
    groups.append(KVCacheGroup(window, ()))
    return len(groups) - 1
