"""LLMEngine: add_request / abort / step. One step reads schedule → execute → update.

Single-threaded by design; `AsyncLLMEngine` (async_engine.py) drives it from its own thread.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import kernels
from .config import EngineConfig
from .kv_cache import KVCacheManager
from .model_runner import ModelRunner, kv_bytes_per_block
from .models import registry
from .models.interface import DTYPES
from .request import Sequence as Seq
from .sampler import SampleResult, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput
from .structured import GrammarCompiler
from .tokenizer import IncrementalDetokenizer, Tokenizer

_DEFAULT_CPU_KV_BYTES = 512 * 1024 * 1024
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_STOP_STRINGS = 256
CHARS_PER_TOKEN_BOUND = 64


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) for TTFT / TPOT / end-to-end latency."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """What one sequence produced in one step (a delta), or its end.

    `text` and `token_ids` are deltas since the previous output of this (request_id, index).
    `logprobs` has one entry per token of `token_ids` when requested: (logprob, top alternatives).
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cumulative_text: str | None = None
    logprobs: list[tuple[float, dict[int, float] | None]] | None = None
    stop_reason: str | int | None = None
    metrics: RequestMetrics | None = None
    # prompt_logprobs, once (with the first output): (token id, logprob, alternatives) per prompt
    # token, the first one (None, None)
    prompt_logprobs: list[tuple[int, float | None, dict[int, float] | None]] | None = None
    # the prompt's token ids (the sequence's own list), with its first token when logprobs are asked
    # for: a token's text is decoded after what precedes it
    prompt_ids: list[int] | None = None
    embedding: list[float] | None = None  # an embed request's answer (vLLM's embed runner: last token, normalised)


@dataclass
class EngineStats:
    """Gauges and counters for metrics (vLLM's names in comments)."""

    num_running: int  # vllm:num_requests_running
    num_waiting: int  # vllm:num_requests_waiting
    num_swapped: int
    kv_cache_usage: float  # vllm:kv_cache_usage_perc (fraction)
    prefix_cache_queries: int  # tokens, vllm:prefix_cache_queries_total
    prefix_cache_hits: int  # tokens, vllm:prefix_cache_hits_total
    num_preemptions: int  # vllm:num_preemptions_total
    prompt_tokens: int  # vllm:prompt_tokens_total
    generation_tokens: int  # vllm:generation_tokens_total
    num_blocks: int = 0
    peak_blocks_used: int = 0
    extra: dict[str, float] = field(default_factory=dict)


_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _generation_defaults(folder: Path) -> dict[str, Any]:
    """generation_config.json's sampling defaults, by vLLM's names (the fields vLLM takes from it)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        return {}
    return {ours: raw[theirs] for theirs, ours in _GENERATION_KEYS.items()
            if isinstance(raw.get(theirs), (int, float)) and not isinstance(raw[theirs], bool)}


def _device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def check_text_length(text: str, max_model_len: int) -> None:
    """Refuse, before tokenizing, text far too long for the context: the tokenizer holds the GIL
    (a 20 MB prompt stalled every request for 30 s). The bound allows 64 characters a token."""
    if len(text) > max_model_len * CHARS_PER_TOKEN_BOUND:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"is {len(text)} characters long, more than that many tokens can hold "
            f"({CHARS_PER_TOKEN_BOUND} characters a token)."
        )


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int], max_model_len: int, vocab: int) -> list[int]:
    """Token ids for a prompt (text is tokenized with special tokens). Raises ValueError. Reads
    fixed settings only: callers tokenize on their own thread (or process), not the engine's."""
    if isinstance(prompt, str):
        check_text_length(prompt, max_model_len)
    elif len(prompt) >= max_model_len:  # before converting a huge list
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains at least {len(prompt)} input tokens, leaving no room for output."
        )
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains at least {len(ids)} input tokens, leaving no room for output."
        )
    if any(t < 0 or t >= vocab for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    return ids


class LLMEngine:
    """The synchronous engine. Not thread-safe: call it from one thread."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        cfg = self.config
        folder = Path(cfg.model_path or model_dir)
        model_cls, self.model_config = registry.resolve(folder)
        self.tokenizer = Tokenizer(folder)
        mc = self.model_config
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if mc.sliding_window is not None and self.max_model_len > mc.sliding_window:
            self.max_model_len = mc.sliding_window  # no sliding-window attention: stay inside the window
        self.device = _device(cfg)
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.model = registry.load_model(folder, model_cls, mc, DTYPES[cfg.dtype], self.device, self.max_model_len + 1)
        per_block = kv_bytes_per_block(self.model, cfg.block_size)
        num_blocks = self._kv_budget() // per_block
        self.kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                 cfg.swap_space_bytes // per_block if cfg.preemption_mode == "swap" else 0)
        self.max_model_len = min(self.max_model_len, num_blocks * cfg.block_size)
        ops = None
        if (cfg.attention == "auto" and self.device.type == "cpu" and cfg.dtype == "float32"
                and cfg.block_size <= 64 and mc.head_dim % 4 == 0):
            ops = kernels.load()
        if ops is not None:
            self.model.use_kernels(ops)
        self.runner = ModelRunner(self.model, cfg.block_size, num_blocks, self.kv.cpu_pool.num_blocks,
                                  None if ops is None else ops.paged_decode_attention)
        self.scheduler = Scheduler(cfg, self.kv)
        self.eos_ids = tuple(mc.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.grammars = GrammarCompiler(self.tokenizer.json, mc.vocab_size, self.eos_ids)
        self.generation_defaults = _generation_defaults(folder) if cfg.generation_config == "auto" else {}
        self._requests: dict[str, list[Seq]] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._peak_blocks = 0

    @classmethod
    def from_parameters(cls, model_dir: str | Path, parameters: Mapping[str, str], **overrides: object) -> LLMEngine:
        """Build from a model config's `parameters` map (strings). Raises ValueError on bad values."""
        return cls(model_dir, EngineConfig.from_parameters(parameters, **overrides))

    def _kv_budget(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory_bytes is not None:
            return cfg.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return max(int(total * cfg.gpu_memory_utilization) - used, 0)
        return _DEFAULT_CPU_KV_BYTES

    # -- requests -------------------------------------------------------------------------------

    def check_text_length(self, text: str) -> None:
        check_text_length(text, self.max_model_len)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.max_model_len, self.model_config.vocab_size)

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (bad prompt, duplicate id)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params = params or SamplingParams()
        if params.max_tokens is not None and params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} cannot be greater than max_model_len="
                             f"{self.max_model_len}. Please request fewer output tokens.")
        for kind, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if k is not None and k > MAX_LOGPROBS:  # a topk past the vocabulary would fail a step
                raise ValueError(f"Requested {kind} logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}")
        if params.n > self.config.max_num_seqs:  # all n sequences run at once, sharing the prompt
            raise ValueError(f"n={params.n} cannot be greater than max_num_seqs={self.config.max_num_seqs}.")
        vocab = self.model_config.vocab_size
        outside = sorted({t for t, _ in params.logit_bias if t >= vocab})
        if outside:
            raise ValueError(f"logit_bias has token ids outside the vocabulary (size {vocab}): {outside[:10]}")
        outside = sorted({t for t in params.stop_token_ids if not 0 <= t < vocab})
        if outside:
            raise ValueError(f"stop_token_ids has token ids outside the vocabulary (size {vocab}): {outside[:10]}")
        if len(params.stop) > MAX_STOP_STRINGS:  # each is searched for after every token, on the engine thread
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        if params.embed and params.n != 1:
            raise ValueError("an embedding request has one sequence (n must be 1)")
        if params.priority != 0 and self.config.scheduling_policy != "priority":  # vLLM's words
            raise ValueError(f"Got priority {params.priority} but Priority scheduling is not enabled.")
        ids = self.encode_prompt(prompt)
        seq = self._new_seq(request_id, 0, ids, params, arrival_time or time.monotonic())
        seq.pending_forks = params.n - 1
        self._requests[request_id] = [seq]
        self._prompt_tokens += len(ids)
        self.scheduler.add(seq)

    def _new_seq(self, request_id: str, index: int, prompt: list[int], params: SamplingParams, arrival: float) -> Seq:
        seq = Seq(f"{request_id}#{index}", request_id, index, prompt, params, arrival_time=arrival)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(params.seed + index)
        seq.detok = IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
        if params.structured_outputs is not None:  # each sequence (n > 1 too) walks its own grammar
            seq.matcher = self.grammars.matcher(params.structured_outputs)
        return seq

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request: its blocks are freed now. Returns its final "abort" outputs (empty if unknown)."""
        seqs = self._requests.pop(request_id, None)
        if not seqs:
            return []
        outs = []
        for seq in seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
                outs.append(self._output(seq, [], [], True))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and report what each touched sequence produced."""
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        self._peak_blocks = max(self._peak_blocks, self.kv.pool.num_blocks - self.kv.pool.num_free)
        seq_ids, logits = self.runner.execute(so)
        if self.runner.prompt_logprobs:
            self._prompt_logprobs(so)
        return self._update(seq_ids, logits)

    def _prompt_logprobs(self, so: SchedulerOutput) -> None:
        """Keep each prompt position's logprob (and top alternatives) from this step's rows."""
        starts = {s.seq_id: s.start_pos for s in so.scheduled}
        for sid, lp in self.runner.prompt_logprobs.items():
            rid, index = sid.rsplit("#", 1)
            seq = self._requests[rid][int(index)]
            k = seq.params.prompt_logprobs or 0
            for r in range(lp.shape[0]):
                pos = starts[sid] + r + 1  # the prompt position this row predicts
                if pos != len(seq.prompt_lp) + 1 or pos >= seq.num_prompt:  # already kept, or past the prompt
                    continue
                tok = seq.prompt_ids[pos]
                top = None
                if k:
                    vals, idx = lp[r].topk(k)
                    top = dict(zip(idx.tolist(), vals.tolist()))
                seq.prompt_lp.append((tok, float(lp[r, tok]), top))

    def _update(self, seq_ids: list[str], logits: torch.Tensor | None) -> list[RequestOutput]:
        if logits is None:
            return []
        rows: list[Seq] = []
        row_of: list[int] = []
        children: list[Seq] = []
        for r, sid in enumerate(seq_ids):
            rid, index = sid.rsplit("#", 1)
            seq = self._requests[rid][int(index)]
            rows.append(seq)
            row_of.append(r)
            for _ in range(seq.pending_forks):  # n > 1: the children sample from the parent's logits
                child = self._new_seq(rid, len(self._requests[rid]), seq.prompt_ids, seq.params, seq.arrival_time)
                child.first_scheduled_time = seq.first_scheduled_time
                self.kv.fork(seq.seq_id, child.seq_id)  # share every prompt block (copy-on-write later)
                child.prompt_lp, child.prompt_lp_sent = seq.prompt_lp, True  # sent once, by the parent
                child.num_computed = seq.num_computed
                self._requests[rid].append(child)
                children.append(child)
                rows.append(child)
                row_of.append(r)
            seq.pending_forks = 0
        for child in children:
            self.scheduler.add_running(child)
        if children:
            logits = logits[torch.tensor(row_of, device=logits.device)]
        pooled = [i for i, seq in enumerate(rows) if seq.params.embed]
        outs: dict[int, RequestOutput] = {}
        if pooled:  # embedding requests: their prompt's last hidden state is the answer
            hidden = self.runner.sample_hidden
            assert hidden is not None
            if children:
                hidden = hidden[torch.tensor(row_of, device=hidden.device)]
            vectors = torch.nn.functional.normalize(hidden[torch.tensor(pooled, device=hidden.device)].float(), dim=-1)
            for i, vector in zip(pooled, vectors.tolist()):
                outs[i] = self._pooled(rows[i], vector)
        sampled = [i for i in range(len(rows)) if i not in outs]
        if sampled:
            if pooled:
                logits = logits[torch.tensor(sampled, device=logits.device)]
            results = sample(logits, [rows[i] for i in sampled], self.eos_ids)
            now = time.monotonic()
            for i, res in zip(sampled, results):
                outs[i] = self._append_token(rows[i], res, now)
        return [outs[i] for i in range(len(rows))]

    def _pooled(self, seq: Seq, vector: list[float]) -> RequestOutput:
        self.scheduler.finish(seq, "stop")
        self._requests.pop(seq.request_id, None)
        out = self._output(seq, [], None, True)
        return dataclasses.replace(out, embedding=vector)

    def _append_token(self, seq: Seq, res: SampleResult, now: float) -> RequestOutput:
        tok = res.token_id
        if seq.matcher is not None and not seq.matcher.is_stopped():
            seq.matcher.consume_token(tok)  # the mask allowed it: the grammar moves on
        seq.token_ids.append(tok)
        seq.output_counts[tok] = seq.output_counts.get(tok, 0) + 1
        self._generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        p = seq.params
        reason = None
        past_min = seq.num_output >= p.min_tokens
        eos = not p.ignore_eos and tok in self.eos_ids
        if past_min and (eos or tok in p.stop_token_ids):
            if p.include_stop_str_in_output:  # as vLLM: a stop token's text is left out by default
                seq.detok.add(tok)
            reason, seq.stop_reason = "stop", None if eos else tok  # as vLLM: EOS has no stop_reason
        elif (stop_str := seq.detok.add(tok, check_stop=past_min)) is not None:
            reason, seq.stop_reason = "stop", stop_str
        elif (p.max_tokens is not None and seq.num_output >= p.max_tokens) or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seqs = self._requests.get(seq.request_id, [])
            if all(s.finished for s in seqs):
                self._requests.pop(seq.request_id, None)
        lp = [(res.logprob, res.top_logprobs)] if p.logprobs is not None else None
        return self._output(seq, [tok], lp, reason is not None)  # type: ignore[arg-type]

    def _output(self, seq: Seq, new_ids: list[int], logprobs: list | None, finished: bool) -> RequestOutput:
        if finished and seq.finish_reason != "abort":
            seq.detok.flush()
        text = seq.detok.take(finished)
        prompt_lp = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_lp_sent and not seq.wants_prompt_logprobs:
            prompt_lp = [(seq.prompt_ids[0], None, None), *seq.prompt_lp]
            seq.prompt_lp_sent = True
        m = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                           seq.last_token_time, seq.finished_time)
        return RequestOutput(
            request_id=seq.request_id, index=seq.index, text=text, token_ids=new_ids, finished=finished,
            finish_reason=seq.finish_reason if finished else None, prompt_tokens=seq.num_prompt,
            completion_tokens=seq.num_output, cumulative_text=seq.detok.text[: seq.detok.emitted],
            logprobs=logprobs, stop_reason=seq.stop_reason if finished else None, metrics=m,
            prompt_logprobs=prompt_lp,
            prompt_ids=seq.prompt_ids if logprobs is not None and seq.num_output == len(new_ids) else None,
        )

    # -- introspection --------------------------------------------------------------------------

    def cache_config_info(self) -> dict[str, str]:
        """vllm:cache_config_info's labels (fixed settings: safe from any thread), so that
        inference gateways read the KV capacity (num_gpu_blocks x block_size) as from vLLM."""
        cfg = self.config
        return {"block_size": str(cfg.block_size), "cache_dtype": cfg.dtype,
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
                "kv_cache_memory_bytes": str(cfg.kv_cache_memory_bytes),
                "kv_cache_size_tokens": str(self.kv.pool.num_blocks * cfg.block_size),
                "num_cpu_blocks": str(self.kv.cpu_pool.num_blocks), "num_gpu_blocks": str(self.kv.pool.num_blocks)}


    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s["running"], num_waiting=s["waiting"], num_swapped=s["swapped"],
            kv_cache_usage=self.kv.pool.usage(), prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=s["preemptions"],
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
            num_blocks=self.kv.pool.num_blocks, peak_blocks_used=self._peak_blocks,
        )

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[list[list[int]]]:
        """Convenience for tests and benchmarks: run to completion; output token ids per request per index."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        base = f"gen{time.monotonic_ns()}-"
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            self.add_request(f"{base}{i}", prompt, p)
        result: dict[str, dict[int, list[int]]] = {f"{base}{i}": {} for i in range(len(prompts))}
        while self.has_unfinished():
            for out in self.step():
                result[out.request_id].setdefault(out.index, []).extend(out.token_ids)
        return [[r[k] for k in sorted(r)] for r in (result[f"{base}{i}"] for i in range(len(prompts)))]
