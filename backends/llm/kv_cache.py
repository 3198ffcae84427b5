"""KV block accounting: the block pool (free lists, ref counts, prefix-hash table, LRU eviction)
and the per-sequence manager the scheduler calls. Pure bookkeeping: no tensors here.

A sequence has one block table per KV cache group (kv_groups.py), all drawn from the one pool. A
sliding-window group's table keeps its length, but the blocks wholly before the window of the next
token to compute go back to the pool as the sequence advances: their entries become `NULL_BLOCK`
placeholders (never read: attention starts at the window's first block or masks what precedes it).

Invariants (checked by `BlockPool.check`):
- every block is either referenced (ref > 0, in no free list) or free (ref == 0, in exactly one
  free list: `_free_plain` if it has no hash, `_free_cached` if it still holds a cached prefix);
- a hashed block is the one the hash table maps its key to;
- sum of the ref counts == number of live (non-placeholder) block-table entries over all sequences
  and groups.
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


NULL_BLOCK = 0  # a given-back entry of a sliding-window group's table (block 0's id: never read there)


@dataclass
class GroupBlocks:
    """One KV cache group's block table of a sequence and the hash chain of its full blocks (every
    one of them, given back or not: the chain goes on from the last). `blocks[:first]` were given back
    (placeholders); while swapped out, `blocks` is empty and `cpu_blocks` holds the live ones."""

    blocks: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    cpu_blocks: list[int] | None = None
    first: int = 0

    @property
    def live(self) -> list[int]:
        return self.blocks[self.first :] if self.first else self.blocks


@dataclass
class SeqBlocks:
    """One sequence's block tables, one per KV cache group. `blocks`, `keys` and `cpu_blocks` are the
    first group's (a model without sliding-window layers has that one only)."""

    groups: list[GroupBlocks]
    salt: int = 0  # the first block's "previous hash": the LoRA adapter id, so adapters never share KV

    @property
    def blocks(self) -> list[int]:
        return self.groups[0].blocks

    @property
    def keys(self) -> list[BlockKey]:
        return self.groups[0].keys

    @property
    def cpu_blocks(self) -> list[int] | None:
        return self.groups[0].cpu_blocks


@dataclass
class PrefixHit:
    """What `computed_prefix` found: the first `num_blocks` full blocks of the prompt are cached, with
    each group's table of them (a sliding-window group's only inside the window of the hit's end:
    placeholders before) and its hash chain."""

    num_blocks: int = 0
    tables: list[list[int]] = field(default_factory=list)
    keys: list[list[BlockKey]] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)

    def held(self) -> list[int]:
        return [b for t, f in zip(self.tables, self.firsts) for b in t[f:]]


NO_HIT = PrefixHit()


class KVCacheManager:
    """Per-sequence block tables over a BlockPool, one per KV cache group (`windows`: each group's
    sliding window, 0 for full attention). A sequence holds ceil(tokens / block_size) entries in each
    table, so at most its last block is partly filled; a sliding-window group's entries before the
    window are placeholders."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_cpu_blocks: int = 0,
                 windows: Sequence[int] = (0,)):
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = CpuSwapPool(num_cpu_blocks)
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.windows = list(windows)
        self.sliding = [g for g, w in enumerate(self.windows) if w]
        self.seqs: dict[str, SeqBlocks] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    def block_table(self, seq_id: str, group: int = 0) -> list[int]:
        return self.seqs[seq_id].groups[group].blocks

    def group_tables(self, seq_id: str) -> list[list[int]]:
        """The block tables of the groups after the first (empty for a model with one group)."""
        return [g.blocks for g in self.seqs[seq_id].groups[1:]]

    def _first_needed(self, g: int, num_computed: int) -> int:
        """The first block of group g the tokens from position `num_computed` on still attend to."""
        w = self.windows[g]
        return max(num_computed - w + 1, 0) // self.block_size if w else 0

    def _salt(self, salt: int, g: int) -> int:
        """Group g's chain start: groups never share blocks (each holds other layers' KV)."""
        return salt if g == 0 else hash((salt, g))

    def computed_prefix(self, seq_id: str, token_ids: Sequence[int], salt: int = 0) -> PrefixHit:
        """Longest run of cached full blocks for a sequence about to be (re)admitted: a full-attention
        group needs every block of it, a sliding-window group those inside the window of its end.
        `salt` starts the hash chain (the LoRA adapter's id: blocks computed under one adapter, or one
        load of it, never match a request of another).

        At most len(token_ids) - 1 tokens: the last token is always computed, for its logits.
        """
        if not self.caching:
            return NO_HIT
        bs = self.block_size
        n = (len(token_ids) - 1) // bs
        keys: list[list[BlockKey]] = []
        found: list[list[int | None]] = []
        for g, w in enumerate(self.windows):
            prev = self._salt(salt, g)
            gk: list[BlockKey] = []
            gf: list[int | None] = []
            for i in range(n):
                key = (prev, tuple(token_ids[i * bs : (i + 1) * bs]))
                b = self.pool.lookup(key)
                if b is None and not w:  # a full-attention group's hit is a run from the start
                    break
                gk.append(key)
                gf.append(b)
                prev = hash(key)
            if not w:
                n = min(n, len(gf))
            keys.append(gk)
            found.append(gf)
        while n and any(None in found[g][self._first_needed(g, n * bs) : n] for g in self.sliding):
            n -= 1
        if not n:
            return NO_HIT
        firsts = [self._first_needed(g, n * bs) for g in range(len(self.windows))]
        tables = [[NULL_BLOCK] * f + [b for b in found[g][f:n] if b is not None] for g, f in enumerate(firsts)]
        return PrefixHit(n, tables, [k[:n] for k in keys], firsts)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (in tokens, as vLLM's prefix-cache metrics do)."""
        if self.caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def can_allocate(self, seq_id: str, num_computed: int, num_new: int, hit: PrefixHit = NO_HIT) -> bool:
        held = hit.held() if hit.num_blocks else ()
        return self.pool.num_free_after_acquire(held) >= self._blocks_needed(seq_id, num_computed, num_new, hit)

    def _blocks_needed(self, seq_id: str, num_computed: int, num_new: int, hit: PrefixHit) -> int:
        sb = self.seqs.get(seq_id)
        total = -(-(num_computed + num_new) // self.block_size)
        if sb is None:
            have = [len(t) for t in hit.tables] if hit.num_blocks else [0] * len(self.windows)
            return sum(max(total - h, 0) for h in have)
        need = 0
        for gb in sb.groups:
            n = total - len(gb.blocks)
            if gb.blocks and num_computed % self.block_size and self.pool.ref[gb.blocks[-1]] > 1:
                n += 1  # copy-on-write of a shared, partly filled last block
            need += max(n, 0)
        return need

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a fresh sequence's first `num_tokens` tokens take (every group holds each chunk's)."""
        return -(-num_tokens // self.block_size) * len(self.windows)

    def allocate(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        num_new: int,
        hit: PrefixHit = NO_HIT,
        salt: int = 0,
    ) -> list[tuple[int, int]] | None:
        """Give the sequence room for `num_new` more tokens; None if the pool is short. Blocks of a
        sliding-window group that the tokens from `num_computed` on no longer attend to go back first.

        `hit` is `computed_prefix`'s (first allocation only; `salt` the one computed_prefix was
        given). Returns the block copies (src, dst) the runner must do first (copy-on-write after a fork).
        """
        sb = self.seqs.get(seq_id)
        if sb is not None and self.sliding:
            self._give_back(sb, num_computed)
        if not self.can_allocate(seq_id, num_computed, num_new, hit):
            return None
        if sb is None:
            if hit.num_blocks:
                groups = [GroupBlocks(list(t), list(k), None, f) for t, k, f in zip(hit.tables, hit.keys, hit.firsts)]
                self.pool.acquire(hit.held())
            else:
                groups = [GroupBlocks() for _ in self.windows]
            sb = self.seqs[seq_id] = SeqBlocks(groups, salt=salt)
        copies: list[tuple[int, int]] = []
        bs = self.block_size
        need = -(-(num_computed + num_new) // bs)
        for g, gb in enumerate(sb.groups):
            if gb.blocks and num_computed % bs and self.pool.ref[gb.blocks[-1]] > 1:
                (new,) = self.pool.allocate(1)
                copies.append((gb.blocks[-1], new))
                self.pool.release([gb.blocks[-1]])
                gb.blocks[-1] = new
            if need > len(gb.blocks):
                gb.blocks.extend(self.pool.allocate(need - len(gb.blocks)))
            if self.caching:  # only blocks of known tokens (never of speculative drafts) get a prefix hash
                self._register_full(gb, self._salt(sb.salt, g), token_ids,
                                    min(num_computed + num_new, len(token_ids)) // bs)
        return copies

    def _give_back(self, sb: SeqBlocks, num_computed: int) -> None:
        """Release each sliding-window group's blocks wholly before the window of position `num_computed`."""
        for g in self.sliding:
            gb = sb.groups[g]
            upto = min(self._first_needed(g, num_computed), len(gb.blocks))
            if upto > gb.first:
                self.pool.release(gb.blocks[gb.first : upto])
                gb.blocks[gb.first : upto] = [NULL_BLOCK] * (upto - gb.first)
                gb.first = upto

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keep the blocks of the sequence's first `num_tokens` tokens, release the rest (the KV
        of rejected speculative tokens)."""
        keep = -(-num_tokens // self.block_size)
        for gb in self.seqs[seq_id].groups:
            if len(gb.blocks) > keep:
                assert keep >= gb.first, "a rollback past a sliding window's given-back blocks"
                self.pool.release(reversed(gb.blocks[keep:]))
                del gb.blocks[keep:]
                del gb.keys[keep:]

    def _register_full(self, gb: GroupBlocks, salt: int, token_ids: Sequence[int], num_full: int) -> None:
        bs = self.block_size
        prev = hash(gb.keys[-1]) if gb.keys else salt
        for i in range(len(gb.keys), num_full):
            key = (prev, tuple(token_ids[i * bs : (i + 1) * bs]))
            if i >= gb.first:
                self.pool.register(gb.blocks[i], key)
            gb.keys.append(key)
            prev = hash(key)

    def free(self, seq_id: str) -> None:
        """Return every block of the sequence (tail first, so its tail is evicted first)."""
        sb = self.seqs.pop(seq_id, None)
        if sb is None:
            return
        for gb in sb.groups:
            self.pool.release(reversed(gb.live))
            if gb.cpu_blocks:
                self.cpu_pool.release(gb.cpu_blocks)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref counts up; copy-on-write later)."""
        sb = self.seqs[parent_id]
        for gb in sb.groups:
            self.pool.acquire(gb.live)
        self.seqs[child_id] = SeqBlocks([GroupBlocks(list(gb.blocks), list(gb.keys), None, gb.first)
                                         for gb in sb.groups], salt=sb.salt)

    def swap_out(self, seq_id: str) -> list[tuple[int, int]] | None:
        """Move the sequence's live blocks to CPU blocks; (device, cpu) copies to do, or None if no room."""
        sb = self.seqs[seq_id]
        if self.cpu_pool.num_free < sum(len(gb.live) for gb in sb.groups):
            return None
        pairs: list[tuple[int, int]] = []
        for gb in sb.groups:
            live = gb.live
            cpu = self.cpu_pool.allocate(len(live))
            pairs.extend(zip(live, cpu))
            self.pool.release(reversed(live))
            gb.blocks, gb.cpu_blocks = [], cpu
        return pairs

    def can_swap_in(self, seq_id: str, num_computed: int, num_new: int) -> bool:
        """Whether the swapped-out sequence fits back with room for `num_new` more tokens."""
        total = -(-(num_computed + num_new) // self.block_size)
        need = 0
        for gb in self.seqs[seq_id].groups:
            assert gb.cpu_blocks is not None
            need += len(gb.cpu_blocks) + max(total - gb.first - len(gb.cpu_blocks), 0)
        return self.pool.num_free >= need

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        """Back to device blocks; (cpu, device) copies to do. The caller checked can_swap_in."""
        pairs: list[tuple[int, int]] = []
        for gb in self.seqs[seq_id].groups:
            assert gb.cpu_blocks is not None
            dev = self.pool.allocate(len(gb.cpu_blocks))
            pairs.extend(zip(gb.cpu_blocks, dev))
            self.cpu_pool.release(gb.cpu_blocks)
            gb.blocks, gb.cpu_blocks = [NULL_BLOCK] * gb.first + dev, None
            gb.keys = []  # the new blocks are not registered; the cached copies may still exist
        return pairs

    def check(self) -> None:
        """Assert pool invariants against the block tables held here, in every group."""
        refs: dict[int, int] = {}
        cpu_held = 0
        for sb in self.seqs.values():
            assert len(sb.groups) == len(self.windows)
            for g, gb in enumerate(sb.groups):
                assert all(b == NULL_BLOCK for b in gb.blocks[: gb.first])
                if self.windows[g] == 0:
                    assert gb.first == 0
                for b in gb.live:
                    refs[b] = refs.get(b, 0) + 1
                cpu_held += len(gb.cpu_blocks or ())
        self.pool.check(refs)
        assert cpu_held + self.cpu_pool.num_free == self.cpu_pool.num_blocks
