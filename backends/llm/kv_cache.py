"""KV block accounting: the block pool (free lists, ref counts, prefix-hash table, LRU eviction)
and the per-sequence manager the scheduler calls. Pure bookkeeping: no tensors here.

Invariants (checked by `BlockPool.check`):
- every block is either referenced (ref > 0, in no free list) or free (ref == 0, in exactly one
  free list: `_free_plain` if it has no hash, `_free_cached` if it still holds a cached prefix);
- a hashed block is the one the hash table maps its key to;
- sum of the ref counts == number of block-table entries over all sequences.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BlockKey = tuple[int, tuple[int, ...]]  # (previous block's hash, this block's token ids)


class BlockPool:
    """Fixed set of block ids. Free blocks without a cached prefix are handed out first; free
    blocks that still hold a cached prefix are evicted least-recently-freed first, only when the
    plain free list is empty."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has room for no block: raise kv_cache_memory_bytes")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[BlockKey | None] = [None] * num_blocks
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._table: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); False, changing nothing, while
        any block is in use (a running request's blocks stay cached when it ends)."""
        if self.num_free != self.num_blocks:
            return False
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        self._table.clear()
        self.key = [None] * self.num_blocks
        return True

    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref 1). The caller checked `num_free >= n`."""
        out = []
        for _ in range(n):
            if self._free_plain:
                b = self._free_plain.popleft()
            else:
                b, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
                key = self.key[b]
                if key is not None and self._table.get(key) == b:
                    del self._table[key]
                self.key[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (prefix-cache hits, forks)."""
        for b in blocks:
            if self.ref[b] == 0:
                del self._free_cached[b]
            self.ref[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference each; a block reaching 0 becomes free (kept cached if hashed)."""
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key[b] is not None:
                    self._free_cached[b] = None
                else:
                    self._free_plain.append(b)

    def lookup(self, key: BlockKey) -> int | None:
        return self._table.get(key)

    def register(self, block: int, key: BlockKey) -> None:
        """Record that `block` holds the full block `key` (first writer wins)."""
        if self.key[block] is None and key not in self._table:
            self._table[key] = block
            self.key[block] = key

    def num_free_after_acquire(self, blocks: Sequence[int]) -> int:
        """Free blocks left once `blocks` (possibly free cached ones) are acquired."""
        return self.num_free - sum(1 for b in blocks if self.ref[b] == 0)

    def check(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert the invariants (tests and debugging)."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        assert len(plain) == len(self._free_plain) and not plain & cached
        for b in range(self.num_blocks):
            free = b in plain or b in cached
            assert (self.ref[b] == 0) == free, f"block {b}: ref {self.ref[b]}, free {free}"
            assert self.ref[b] >= 0
            if b in cached:
                assert self.key[b] is not None
            if self.key[b] is not None:
                assert self._table.get(self.key[b]) == b  # type: ignore[arg-type]
        if expected_refs is not None:
            for b in range(self.num_blocks):
                assert self.ref[b] == expected_refs.get(b, 0), f"block {b}: ref {self.ref[b]}"


class CpuSwapPool:
    """Block ids of the CPU swap area (no caching, no sharing)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: Iterable[int]) -> None:
        self._free.extend(blocks)


@dataclass
class SeqBlocks:
    """One sequence's block table and the hash chain of its full, registered blocks."""

    blocks: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    cpu_blocks: list[int] | None = None  # set while swapped out
    salt: int = 0  # the first block's "previous hash": the LoRA adapter id, so adapters never share KV


class KVCacheManager:
    """Per-sequence block tables over a BlockPool. A sequence holds ceil(tokens / block_size)
    blocks, so at most its last block is partly filled."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int = 0):
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = CpuSwapPool(num_cpu_blocks)
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.seqs: dict[str, SeqBlocks] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    def block_table(self, seq_id: str) -> list[int]:
        return self.seqs[seq_id].blocks

    def computed_prefix(self, seq_id: str, token_ids: Sequence[int], salt: int = 0
                        ) -> tuple[list[int], list[BlockKey]]:
        """Longest run of cached full blocks for a sequence about to be (re)admitted. `salt` starts
        the hash chain (the LoRA adapter's id: blocks computed under one adapter, or one load of it,
        never match a request of another).

        At most len(token_ids) - 1 tokens: the last token is always computed, for its logits.
        """
        if not self.caching:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        keys: list[BlockKey] = []
        prev = salt
        for i in range((len(token_ids) - 1) // bs):
            key = (prev, tuple(token_ids[i * bs : (i + 1) * bs]))
            b = self.pool.lookup(key)
            if b is None:
                break
            blocks.append(b)
            keys.append(key)
            prev = hash(key)
        return blocks, keys

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (in tokens, as vLLM's prefix-cache metrics do)."""
        if self.caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def can_allocate(self, seq_id: str, num_computed: int, num_new: int, cached: Sequence[int] = ()) -> bool:
        return self.pool.num_free_after_acquire(cached) >= self._blocks_needed(seq_id, num_computed, num_new, cached)

    def _blocks_needed(self, seq_id: str, num_computed: int, num_new: int, cached: Sequence[int]) -> int:
        sb = self.seqs.get(seq_id)
        have = len(sb.blocks) if sb else len(cached)
        need = -(-(num_computed + num_new) // self.block_size) - have
        if sb and sb.blocks and num_computed % self.block_size and self.pool.ref[sb.blocks[-1]] > 1:
            need += 1  # copy-on-write of a shared, partly filled last block
        return max(need, 0)

    def allocate(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        num_new: int,
        cached: Sequence[int] = (),
        cached_keys: Sequence[BlockKey] = (),
        salt: int = 0,
    ) -> list[tuple[int, int]] | None:
        """Give the sequence room for `num_new` more tokens; None if the pool is short.

        `cached` are prefix blocks from `computed_prefix` (first allocation only; `salt` the one
        computed_prefix was given). Returns the
        block copies (src, dst) the runner must do first (copy-on-write after a fork).
        """
        if not self.can_allocate(seq_id, num_computed, num_new, cached):
            return None
        sb = self.seqs.get(seq_id)
        if sb is None:
            sb = self.seqs[seq_id] = SeqBlocks(list(cached), list(cached_keys), salt=salt)
            self.pool.acquire(cached)
        copies: list[tuple[int, int]] = []
        bs = self.block_size
        if sb.blocks and num_computed % bs and self.pool.ref[sb.blocks[-1]] > 1:
            (new,) = self.pool.allocate(1)
            copies.append((sb.blocks[-1], new))
            self.pool.release([sb.blocks[-1]])
            sb.blocks[-1] = new
        need = -(-(num_computed + num_new) // bs) - len(sb.blocks)
        if need > 0:
            sb.blocks.extend(self.pool.allocate(need))
        if self.caching:  # only blocks of known tokens (never of speculative drafts) get a prefix hash
            self._register_full(sb, token_ids, min(num_computed + num_new, len(token_ids)) // bs)
        return copies

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keep the blocks of the sequence's first `num_tokens` tokens, release the rest (the KV
        of rejected speculative tokens)."""
        sb = self.seqs[seq_id]
        keep = -(-num_tokens // self.block_size)
        if len(sb.blocks) > keep:
            self.pool.release(reversed(sb.blocks[keep:]))
            del sb.blocks[keep:]
            del sb.keys[keep:]

    def _register_full(self, sb: SeqBlocks, token_ids: Sequence[int], num_full: int) -> None:
        bs = self.block_size
        prev = hash(sb.keys[-1]) if sb.keys else sb.salt
        for i in range(len(sb.keys), num_full):
            key = (prev, tuple(token_ids[i * bs : (i + 1) * bs]))
            self.pool.register(sb.blocks[i], key)
            sb.keys.append(key)
            prev = hash(key)

    def free(self, seq_id: str) -> None:
        """Return every block of the sequence (tail first, so its tail is evicted first)."""
        sb = self.seqs.pop(seq_id, None)
        if sb is None:
            return
        self.pool.release(reversed(sb.blocks))
        if sb.cpu_blocks:
            self.cpu_pool.release(sb.cpu_blocks)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref counts up; copy-on-write later)."""
        sb = self.seqs[parent_id]
        self.pool.acquire(sb.blocks)
        self.seqs[child_id] = SeqBlocks(list(sb.blocks), list(sb.keys), salt=sb.salt)

    def swap_out(self, seq_id: str) -> list[tuple[int, int]] | None:
        """Move the sequence to CPU blocks; (device, cpu) copies to do, or None if no room."""
        sb = self.seqs[seq_id]
        if self.cpu_pool.num_free < len(sb.blocks):
            return None
        cpu = self.cpu_pool.allocate(len(sb.blocks))
        pairs = list(zip(sb.blocks, cpu))
        self.pool.release(reversed(sb.blocks))
        sb.blocks, sb.cpu_blocks = [], cpu
        return pairs

    def can_swap_in(self, seq_id: str) -> bool:
        sb = self.seqs[seq_id]
        return sb.cpu_blocks is not None and self.pool.num_free >= len(sb.cpu_blocks)

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        """Back to device blocks; (cpu, device) copies to do. The caller checked can_swap_in."""
        sb = self.seqs[seq_id]
        assert sb.cpu_blocks is not None
        dev = self.pool.allocate(len(sb.cpu_blocks))
        pairs = list(zip(sb.cpu_blocks, dev))
        self.cpu_pool.release(sb.cpu_blocks)
        sb.blocks, sb.cpu_blocks = dev, None
        sb.keys = []  # the new blocks are not registered; the cached copies may still exist
        return pairs

    def check(self) -> None:
        """Assert pool invariants against the block tables held here."""
        refs: dict[int, int] = {}
        for sb in self.seqs.values():
            for b in sb.blocks:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check(refs)
        cpu_held = sum(len(sb.cpu_blocks or ()) for sb in self.seqs.values())
        assert cpu_held + self.cpu_pool.num_free == self.cpu_pool.num_blocks
