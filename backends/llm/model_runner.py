"""SchedulerOutput → input ids, positions, slot mapping, block tables → forward → sampled tokens.

Owns the KV cache tensors (device), the swap area (CPU) and the sampler with its per-sequence state
(`sampler.SamplingState`, kept from the step a sequence is first scheduled to the step after it
ends), so that a step is one call: `execute(scheduler output, grammar bitmask)` -> ModelRunnerOutput.
Never touches queues, grammars or text.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from .attention import AttentionMetadata, DecodeBatch, DecodeGroup, LayerKV, PrefillChunk, prefix_causal_mask
from .kv_fp8 import KVScales
from .kv_groups import KVCacheGroup, group_layers, group_of, num_slots
from .layers.lora import LoRABatch
from .models.interface import CausalLM, KVCacheSpec
from .outputs import ModelRunnerOutput, PromptLogprobs
from .sampler import SamplingState, sample
from .scheduler_output import GrammarBitmask, ScheduledSeq, SchedulerOutput
from .spec_decode import SpecDecodeStats, verify
from .spec_draft import Drafter

# A decode group closes when the next (longer) sequence needs this many times the blocks of the
# group's shortest one: bounds padding waste while keeping the number of SDPA calls small.
_GROUP_GROWTH = 1.25
_MIN_GROUP = 4
# With the compiled decode kernel, a prefill chunk of at most this many tokens attends through it too,
# one query per token (its context up to itself): no per-chunk gather and SDPA call in every layer.
# Longer chunks keep SDPA, whose tiles reuse K/V across queries.
_KERNEL_PREFILL = 64

log = logging.getLogger(__name__)


def kv_cache_specs(model: CausalLM, kv_dtype: torch.dtype | None = None) -> list[KVCacheSpec]:
    """The model's per-layer KV specs, in `kv_dtype` when the cache is not in the model's dtype (FP8)."""
    specs = model.kv_cache_specs()
    return specs if kv_dtype is None else [dataclasses.replace(s, dtype=kv_dtype) for s in specs]


def kv_bytes_per_block(model: CausalLM, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
    """What one block id (block_size tokens) takes: K and V of one layer per cache slot (kv_groups.py;
    every layer's with one KV cache group)."""
    specs = kv_cache_specs(model, kv_dtype)
    return sum(spec.bytes_per_block(block_size) for spec in _slot_specs(specs, group_layers(specs)))


def _slot_specs(specs: list[KVCacheSpec], groups: list[KVCacheGroup]) -> list[KVCacheSpec]:
    """The spec of each cache slot: that of the first group's layer stored there (the groups' layers
    that share a slot have the same one)."""
    return [next(specs[g.layers[j]] for g in groups if j < len(g.layers)) for j in range(num_slots(groups))]


class ModelRunner:
    """Runs one step of the model over paged KV caches."""

    def __init__(self, model: CausalLM, block_size: int, num_blocks: int, num_cpu_blocks: int,
                 eos_ids: tuple[int, ...], decode_op: Callable[..., None] | None = None,
                 draft: CausalLM | None = None, kv_dtype: torch.dtype | None = None,
                 kv_scales: list[KVScales] | None = None) -> None:
        """`draft`: speculative decoding's draft model (spec_draft.py), with KV caches of its own
        under the same block ids (in the model's dtype); `kv_dtype`: an FP8 cache's dtype (None: the
        model's), with one `kv_scales` entry per layer."""
        self.model = model
        # the LoRA layers' row mapping (layers/lora.py; the engine sets it with LoRA on): set here each
        # step from the sequences' adapter ids
        self.lora: LoRABatch | None = None
        self.eos_ids = eos_ids
        self.states: dict[str, SamplingState] = {}  # seq id -> its sampler state
        self.decode_op = decode_op  # the compiled paged decode kernel, or None for the torch path
        self.block_size = block_size
        self.num_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        self.spec_stats = SpecDecodeStats()
        layer_specs = kv_cache_specs(model, kv_dtype)
        self.kv_scales = kv_scales if kv_dtype is not None else None
        self._scales_logged = False
        # the KV cache groups (kv_groups.py): a layer's K/V live in its slot's tensors, read through
        # its group's block tables
        self.kv_groups = group_layers(layer_specs)
        specs = _slot_specs(layer_specs, self.kv_groups)
        slots = [self._cache(s, num_blocks, model.device) for s in specs]
        self.kv_caches: list[LayerKV] = [None] * len(layer_specs)  # type: ignore[list-item]
        for gi, g in enumerate(self.kv_groups):
            for j, layer in enumerate(g.layers):
                self.kv_caches[layer] = LayerKV(*slots[j], None if kv_scales is None else kv_scales[layer], gi)
        self.slot_caches: list[tuple[torch.Tensor, torch.Tensor]] = slots
        self.drafter = None
        if draft is not None:  # its layers read the tables of the group of their attention kind
            draft_specs = draft.kv_cache_specs()
            caches = [LayerKV(*self._cache(s, num_blocks, model.device), None, group_of(self.kv_groups, s.window))
                      for s in draft_specs]
            self.drafter = Drafter(draft, caches, model.config.vocab_size)  # type: ignore[arg-type]
            self.slot_caches = [*slots, *caches]
            specs = [*specs, *draft_specs]  # the swap area holds both models' blocks
        self.kv_windows = [g.window for g in self.kv_groups]  # each group's, for the block accounting
        self.cpu_caches = [self._cache(s, num_cpu_blocks, torch.device("cpu"), pin=model.device.type == "cuda")
                           for s in specs] if num_cpu_blocks else []

    def _cache(self, spec: KVCacheSpec, num_blocks: int, device: torch.device, pin: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V caches; K block-transposed for the compiled decode kernel (see attention.py)."""
        kvh, hd, bs = spec.num_kv_heads, spec.head_dim, self.block_size
        k_block = (hd, bs) if self.decode_op is not None else (bs, hd)
        return (torch.zeros((kvh, num_blocks, *k_block), dtype=spec.dtype, device=device, pin_memory=pin),
                torch.zeros((kvh, num_blocks, bs, hd), dtype=spec.dtype, device=device, pin_memory=pin))

    def execute(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """`prepare`, then `run`: the step whole."""
        self.prepare(so)
        return self.run(so, grammar)

    @torch.inference_mode()
    def prepare(self, so: SchedulerOutput) -> None:
        """Update the sequences' states, do the block moves, and have the draft model fill in the
        drafts the scheduler made room for (tensor parallelism: rank 0 does this before it ships the
        step, so the other ranks run the same tokens)."""
        for sid in so.finished_seq_ids:
            self.states.pop(sid, None)
        dev = self.model.device
        for new in so.new_seqs:
            self.states[new.seq_id] = SamplingState.new(new.params, new.index, new.prompt_ids, dev)
        self._move_blocks(so)
        if self.drafter is not None and so.scheduled:
            self.drafter.propose(self.forward, so)

    @torch.inference_mode()
    def run(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Run the forward over a prepared step, then sample (or pool) for each sequence whose chunk
        reached its end. `grammar`: structured output's bitmask for the sampling sequences that have
        a grammar."""
        out = ModelRunnerOutput()
        if not so.scheduled:
            return out
        dev = self.model.device
        hidden, sampling, lp_rows = self.forward(so)
        for s, a, n in lp_rows:
            out.prompt_logprobs[s.seq_id] = self._prompt_logprobs(s, hidden[a : a + n])
        if not sampling:
            return out
        rows, seq_ids, states = [], [], []  # per entry: its hidden row, sequence, state (forks after their parent)
        for row, s in sampling:
            parent = self.states[s.seq_id]
            for sid, index in [(s.seq_id, -1), *s.forks]:
                if index >= 0:
                    self.states[sid] = parent.fork(index, dev)
                rows.append(row)
                seq_ids.append(sid)
                states.append(self.states[sid])
        pooled = [i for i, st in enumerate(states) if st.params.embed]
        if pooled:  # embedding requests: their prompt's last hidden state is the answer
            vectors = torch.nn.functional.normalize(hidden[torch.tensor([rows[i] for i in pooled], device=dev)].float(),
                                                    dim=-1)
            out.pooled = {seq_ids[i]: v for i, v in zip(pooled, vectors.tolist())}
        sampled = [i for i in range(len(states)) if not states[i].params.embed]
        if not sampled:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor([rows[i] for i in sampled], device=dev)])
        picked = [states[i] for i in sampled]
        masked = None
        if grammar is not None:  # a fork's children start where their parent's grammar is
            at = {sid: j for j, sid in enumerate(grammar.seq_ids)}
            parent_of = {sid: s.seq_id for _, s in sampling for sid, _ in s.forks}
            masked = ([at[parent_of.get(seq_ids[i], seq_ids[i])] for i in sampled if states[i].structured],
                      grammar.bitmask)
        results = sample(logits, picked, self.eos_ids, masked)
        per_entry = [[r] for r in results]
        drafts = {s.seq_id: s.draft_token_ids for _, s in sampling if s.draft_token_ids}
        if drafts:  # speculative decoding: accept the drafts the sampler agrees with
            spec = [j for j, i in enumerate(sampled) if seq_ids[i] in drafts]
            spec_drafts = [drafts[seq_ids[sampled[j]]] for j in spec]
            draft_rows = [rows[sampled[j]] + k for j, d in zip(spec, spec_drafts) for k in range(1, len(d) + 1)]
            verified = verify([results[j] for j in spec], spec_drafts, [picked[j] for j in spec],
                              self.model.compute_logits(hidden[torch.tensor(draft_rows, device=dev)]),
                              lambda lg, st: sample(lg, st, self.eos_ids), self.spec_stats)
            for j, tokens, d in zip(spec, verified, spec_drafts):
                per_entry[j] = tokens
                if self.drafter is not None:
                    self.drafter.verified(seq_ids[sampled[j]], len(tokens) > len(d))
        for i, tokens, st in zip(sampled, per_entry, picked):  # a sequence's tokens in order
            want_lp = st.params.logprobs is not None
            for r in tokens:
                out.seq_ids.append(seq_ids[i])
                out.sampled_token_ids.append(r.token_id)
                out.logprobs.append((r.logprob, r.top_logprobs) if want_lp else None)  # type: ignore[arg-type]
        return out

    def forward(self, so: SchedulerOutput, model: CausalLM | None = None,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                ) -> tuple[torch.Tensor, list[tuple[int, ScheduledSeq]], list[tuple[ScheduledSeq, int, int]]]:
        """Run the model (or `model` over `kv_caches`: the draft's) over the step's tokens: (hidden
        states, (row, seq) of each chunk that samples, (seq, first row, rows) of each chunk that
        wants prompt logprobs)."""
        decodes = sorted((s for s in so.scheduled if len(s.token_ids) == 1), key=lambda s: s.start_pos)
        prefills = [s for s in so.scheduled if len(s.token_ids) > 1]
        ids: list[int] = []
        positions: list[int] = []
        sampling: list[tuple[int, ScheduledSeq]] = []
        lp_rows: list[tuple[ScheduledSeq, int, int]] = []
        for s in decodes:
            if s.prompt_logprobs:  # a one-token prompt chunk
                lp_rows.append((s, len(ids), 1))
            ids.append(s.token_ids[0])
            positions.append(s.start_pos)
            if s.sample:
                sampling.append((len(ids) - 1, s))
        if self.decode_op is not None:
            short = [s for s in prefills if len(s.token_ids) <= _KERNEL_PREFILL]
            prefills = short + [s for s in prefills if len(s.token_ids) > _KERNEL_PREFILL]
        for s in prefills:
            n = len(s.token_ids)
            if s.prompt_logprobs:
                lp_rows.append((s, len(ids), n))
            ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + n))
            if s.sample:  # the row of the last known token (drafts follow it)
                sampling.append((len(ids) - 1 - len(s.draft_token_ids), s))
        dev = self.model.device
        meta = self._metadata(decodes, prefills, _first_table, dev)
        if len(self.kv_groups) > 1:  # each layer reads its group's (layers/attention.py)
            meta.groups = [meta, *(self._metadata(decodes, prefills, _group_table(g), dev)
                                   for g in range(1, len(self.kv_groups)))]
        if self.lora is not None and model in (None, self.model):  # each row's adapter, in the rows' order
            self.lora.set([s.lora_id for s in decodes] + [s.lora_id for s in prefills for _ in s.token_ids], dev)
        hidden = (model or self.model).forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                                               self.kv_caches if kv_caches is None else kv_caches,  # type: ignore[arg-type]
                                               meta)
        if self.kv_scales is not None and not self._scales_logged:
            self._log_scales()
        return hidden, sampling, lp_rows

    def _metadata(self, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq],
                  table_of: Callable[[ScheduledSeq], list[int]], dev: torch.device) -> AttentionMetadata:
        """The attention metadata of the step's rows (decodes, then prefills) over one KV cache
        group's block tables (`table_of`)."""
        bs = self.block_size
        slots = []
        for s in decodes:
            slots.append(table_of(s)[s.start_pos // bs] * bs + s.start_pos % bs)
        # (block table, context length) of each row the kernel attends: the decodes, then short prefills' tokens
        kernel_rows: list[tuple[list[int], int]] = []
        groups: list[DecodeGroup] = []
        if self.decode_op is not None:
            kernel_rows = [(table_of(s), s.start_pos + 1) for s in decodes]
        else:
            groups = self._decode_groups(decodes, dev, table_of)
        chunks: list[PrefillChunk] = []
        start = len(decodes)
        for s in prefills:
            n = len(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            table = table_of(s)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if self.decode_op is not None and n <= _KERNEL_PREFILL:
                kernel_rows.extend((table, p + 1) for p in pos)
            elif s.start_pos:
                nb = -(-(s.start_pos + n) // bs)
                chunks.append(PrefillChunk(start, n, s.start_pos, torch.tensor(table[:nb], device=dev),
                                           prefix_causal_mask(s.start_pos, n, dev)))
            else:
                chunks.append(PrefillChunk(start, n, 0, None, None))
            start += n
        decode = self._decode_batch(kernel_rows, dev) if kernel_rows else None
        return AttentionMetadata(torch.tensor(slots, device=dev), groups, decode, chunks,
                                 k_transposed=self.decode_op is not None)

    def _log_scales(self) -> None:
        """Say once which K/V scales the FP8 cache runs with (derived ones after the first prefill)."""
        assert self.kv_scales is not None
        if not all(s.ready for s in self.kv_scales):
            return
        self._scales_logged = True
        for source in ("checkpoint", "derived"):
            picked = [(i, s) for i, s in enumerate(self.kv_scales) if s.source == source]
            if picked:
                log.info("FP8 KV cache: %d layers' scales %s (k_scale, v_scale): %s", len(picked),
                         "from the checkpoint" if source == "checkpoint" else
                         "derived from the first prefill (its largest |K|, |V| x 4 headroom; vLLM would use 1.0)",
                         ", ".join(f"{i}: {s.k:.4g}, {s.v:.4g}" for i, s in picked))

    @property
    def kv_clamped(self) -> int:
        """Values clamped to the FP8 format's range when stored, over every layer (0 without FP8)."""
        return sum(s.clamped for s in self.kv_scales or ())

    def _prompt_logprobs(self, s: ScheduledSeq, hidden: torch.Tensor) -> PromptLogprobs:
        """Row r of a prompt chunk predicts the token at position start_pos + r + 1: its logprob
        (and the top alternatives), for the positions inside the prompt."""
        state = self.states[s.seq_id]
        assert state.prompt_ids is not None
        first = s.start_pos + 1
        m = max(min(hidden.shape[0], state.num_prompt - first), 0)
        lp = torch.log_softmax(self.model.compute_logits(hidden[:m]), dim=-1)
        tokens = torch.tensor(state.prompt_ids[first : first + m], device=lp.device)
        values = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        k = state.params.prompt_logprobs or 0
        top = None
        if k:
            vals, idx = lp.topk(k, dim=-1)
            top = [dict(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        return PromptLogprobs(first, values, top)

    def _decode_batch(self, rows: list[tuple[list[int], int]], dev: torch.device) -> DecodeBatch:
        """Block tables (padded with block 0) and context lengths of the kernel's rows (one query each)."""
        assert self.decode_op is not None
        width = max(len(table) for table, _ in rows)
        tables = [table + [0] * (width - len(table)) for table, _ in rows]
        return DecodeBatch(len(rows), torch.tensor(tables, dtype=torch.int32, device=dev),
                           torch.tensor([ctx for _, ctx in rows], dtype=torch.int32, device=dev), self.decode_op)

    def _decode_groups(self, decodes: list[ScheduledSeq], dev: torch.device,
                       table_of: Callable[[ScheduledSeq], list[int]]) -> list[DecodeGroup]:
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
                table = table_of(s)[:nb]
                block_ids.extend(table)
                block_ids.extend([0] * (nb - len(table)))
            ctx = torch.tensor([s.start_pos + 1 for s in members], device=dev)
            if bool((ctx == nb * bs).all()):
                mask = None
            else:
                mask = (torch.arange(nb * bs, device=dev).unsqueeze(0) < ctx.unsqueeze(1)).view(len(members), 1, 1, -1)
            groups.append(DecodeGroup(i, len(members), nb, torch.tensor(block_ids, device=dev), mask, ctx))
            i = j
        return groups

    def _move_blocks(self, so: SchedulerOutput) -> None:
        """The scheduler's block moves, in every KV cache (the draft model's too), on raw bytes (an FP8
        cache's float8 has no index_copy kernel)."""
        dev = self.model.device
        caches = self.slot_caches
        if so.blocks_to_swap_out:
            src = torch.tensor([d for d, _ in so.blocks_to_swap_out], device=dev)
            dst = torch.tensor([c for _, c in so.blocks_to_swap_out])
            for (k, v), (ck, cv) in zip(_raw(caches), _raw(self.cpu_caches)):
                ck[:, dst] = k[:, src].cpu()
                cv[:, dst] = v[:, src].cpu()
        if so.blocks_to_copy:
            src = torch.tensor([s for s, _ in so.blocks_to_copy], device=dev)
            dst = torch.tensor([d for _, d in so.blocks_to_copy], device=dev)
            for k, v in _raw(caches):
                k[:, dst] = k[:, src]
                v[:, dst] = v[:, src]
        if so.blocks_to_swap_in:
            src = torch.tensor([c for c, _ in so.blocks_to_swap_in])
            dst = torch.tensor([d for _, d in so.blocks_to_swap_in], device=dev)
            for (k, v), (ck, cv) in zip(_raw(caches), _raw(self.cpu_caches)):
                k[:, dst] = ck[:, src].to(dev)
                v[:, dst] = cv[:, src].to(dev)


def _first_table(s: ScheduledSeq) -> list[int]:
    return s.block_table


def _group_table(g: int) -> Callable[[ScheduledSeq], list[int]]:
    """Group g's (g > 0) block table of a scheduled sequence."""
    return lambda s: s.group_tables[g - 1]


def _raw(caches: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each cache's bytes (a block is a slice of dim 1 in any dtype; float8 has no index_copy kernel)."""
    return [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in caches]
