"""SchedulerOutput → input ids, positions, slot mapping, block tables → logits.

Owns the KV cache tensors (device) and the swap area (CPU). Never touches queues.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .attention import AttentionMetadata, DecodeBatch, DecodeGroup, PrefillChunk, prefix_causal_mask
from .models.interface import CausalLM, KVCacheSpec
from .scheduler_output import ScheduledSeq, SchedulerOutput

# A decode group closes when the next (longer) sequence needs this many times the blocks of the
# group's shortest one: bounds padding waste while keeping the number of SDPA calls small.
_GROUP_GROWTH = 1.25
_MIN_GROUP = 4


def kv_bytes_per_block(model: CausalLM, block_size: int) -> int:
    """What one block (block_size tokens) takes in every layer's K and V caches."""
    return sum(spec.bytes_per_block(block_size) for spec in model.kv_cache_specs())


class ModelRunner:
    """Runs one step of the model over paged KV caches."""

    def __init__(self, model: CausalLM, block_size: int, num_blocks: int, num_cpu_blocks: int,
                 decode_op: Callable[..., None] | None = None) -> None:
        self.model = model
        self.decode_op = decode_op  # the compiled paged decode kernel, or None for the torch path
        self.block_size = block_size
        specs = model.kv_cache_specs()
        self.kv_caches = [self._cache(s, num_blocks, model.device) for s in specs]
        self.cpu_caches = [self._cache(s, num_cpu_blocks, torch.device("cpu"), pin=model.device.type == "cuda")
                           for s in specs] if num_cpu_blocks else []

    def _cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device, pin: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V caches; K block-transposed for the compiled decode kernel (see attention.py)."""
        kvh, hd, bs = spec.num_kv_heads, spec.head_dim, self.block_size
        k_block = (hd, bs) if self.decode_op is not None else (bs, hd)
        return (torch.zeros((kvh, num_blocks, *k_block), dtype=spec.dtype, device=device, pin_memory=pin),
                torch.zeros((kvh, num_blocks, bs, hd), dtype=spec.dtype, device=device, pin_memory=pin))

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> tuple[list[str], torch.Tensor | None]:
        """Do the block moves, run the forward; return (seq ids that sample, their logits [M, V])."""
        self.prompt_logprobs: dict[str, torch.Tensor] = {}
        self.sample_hidden: torch.Tensor | None = None
        self._move_blocks(so)
        if not so.scheduled:
            return [], None
        decodes = sorted((s for s in so.scheduled if len(s.token_ids) == 1), key=lambda s: s.start_pos)
        prefills = [s for s in so.scheduled if len(s.token_ids) > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        lp_rows: list[tuple[str, int, int]] = []  # (seq id, first row, rows) that want prompt logprobs
        bs = self.block_size
        for s in decodes:
            if s.prompt_logprobs:  # a one-token prompt chunk
                lp_rows.append((s.seq_id, len(ids), 1))
            ids.append(s.token_ids[0])
            positions.append(s.start_pos)
            slots.append(s.block_table[s.start_pos // bs] * bs + s.start_pos % bs)
            if s.sample:
                sample_rows.append(len(ids) - 1)
                sample_ids.append(s.seq_id)
        dev = self.model.device
        if self.decode_op is not None and decodes:
            groups: list[DecodeGroup] = []
            decode = self._decode_batch(decodes, dev)
        else:
            groups, decode = self._decode_groups(decodes, dev), None
        chunks: list[PrefillChunk] = []
        for s in prefills:
            n = len(s.token_ids)
            start = len(ids)
            if s.prompt_logprobs:
                lp_rows.append((s.seq_id, start, n))
            ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            table = s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if s.start_pos:
                nb = -(-(s.start_pos + n) // bs)
                chunks.append(PrefillChunk(start, n, s.start_pos, torch.tensor(table[:nb], device=dev),
                                           prefix_causal_mask(s.start_pos, n, dev)))
            else:
                chunks.append(PrefillChunk(start, n, 0, None, None))
            if s.sample:
                sample_rows.append(len(ids) - 1)
                sample_ids.append(s.seq_id)
        meta = AttentionMetadata(torch.tensor(slots, device=dev), groups, decode, chunks,
                                 k_transposed=self.decode_op is not None)
        hidden = self.model.forward(
            torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.kv_caches, meta
        )
        # prompt logprobs: each row's log-softmax (row r predicts the token at position start_pos + r + 1)
        self.prompt_logprobs = {sid: torch.log_softmax(self.model.compute_logits(hidden[a : a + n]), dim=-1)
                                for sid, a, n in lp_rows}
        if not sample_rows:
            self.sample_hidden = None
            return [], None
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, device=dev)]
        self.sample_hidden = hidden  # the sampling rows' final hidden states (embedding requests pool them)
        return sample_ids, self.model.compute_logits(hidden)

    def _decode_batch(self, decodes: list[ScheduledSeq], dev: torch.device) -> DecodeBatch:
        """Block tables (padded with block 0) and context lengths of every decode, for the kernel."""
        assert self.decode_op is not None
        width = max(len(s.block_table) for s in decodes)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in decodes]
        return DecodeBatch(len(decodes), torch.tensor(tables, dtype=torch.int32, device=dev),
                           torch.tensor([s.start_pos + 1 for s in decodes], dtype=torch.int32, device=dev),
                           self.decode_op)

    def _decode_groups(self, decodes: list[ScheduledSeq], dev: torch.device) -> list[DecodeGroup]:
        """Split the length-sorted decodes into a few groups, each padded to its longest context."""
        bs = self.block_size
        groups: list[DecodeGroup] = []
        i = 0
        while i < len(decodes):
            first_nb = decodes[i].start_pos // bs + 1
            j = i + 1
            while j < len(decodes):
                nb = decodes[j].start_pos // bs + 1
                if j - i >= _MIN_GROUP and nb > first_nb * _GROUP_GROWTH:
                    break
                j += 1
            members = decodes[i:j]
            nb = members[-1].start_pos // bs + 1
            block_ids: list[int] = []
            for s in members:
                table = s.block_table[:nb]
                block_ids.extend(table)
                block_ids.extend([0] * (nb - len(table)))
            ctx = torch.tensor([s.start_pos + 1 for s in members], device=dev)
            if bool((ctx == nb * bs).all()):
                mask = None
            else:
                mask = (torch.arange(nb * bs, device=dev).unsqueeze(0) < ctx.unsqueeze(1)).view(len(members), 1, 1, -1)
            groups.append(DecodeGroup(i, len(members), nb, torch.tensor(block_ids, device=dev), mask))
            i = j
        return groups

    def _move_blocks(self, so: SchedulerOutput) -> None:
        dev = self.model.device
        if so.blocks_to_swap_out:
            src = torch.tensor([d for d, _ in so.blocks_to_swap_out], device=dev)
            dst = torch.tensor([c for _, c in so.blocks_to_swap_out])
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches):
                ck[:, dst] = k[:, src].cpu()
                cv[:, dst] = v[:, src].cpu()
        if so.blocks_to_copy:
            src = torch.tensor([s for s, _ in so.blocks_to_copy], device=dev)
            dst = torch.tensor([d for _, d in so.blocks_to_copy], device=dev)
            for k, v in self.kv_caches:
                k[:, dst] = k[:, src]
                v[:, dst] = v[:, src]
        if so.blocks_to_swap_in:
            src = torch.tensor([c for c, _ in so.blocks_to_swap_in])
            dst = torch.tensor([d for _, d in so.blocks_to_swap_in], device=dev)
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches):
                k[:, dst] = ck[:, src].to(dev)
                v[:, dst] = cv[:, src].to(dev)
