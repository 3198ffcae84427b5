"""LLMEngine: add_request / abort / step (vLLM's EngineCore: the stepping engine; docs/llm.md maps the names).

A step is schedule → the structured-output bitmask → the model runner (forward and sampling, one
call returning a ModelRunnerOutput) → the output processor (stop checks, text deltas). Request checks
are input_processor.py's. Single-threaded by design: `AsyncLLMEngine` (async_engine.py) drives it
from a thread, engine_core.py from a process of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pier.contract.backend import LoadProgress

from . import kernels, kv_fp8
from .config import CacheConfig, EngineConfig, ParallelConfig
from .input_processor import InputProcessor, check_text_length
from .kv_cache import KVCacheManager
from .kv_groups import max_seq_tokens
from .layers.linear import gemm_dtype, onednn_available
from .layers.lora import LoRABatch
from .lora import Adapter, LoRAManager
from .model_runner import ModelRunner, kv_bytes_per_block
from .models import registry
from .models.hf_config import ArchConfig
from .models.interface import DTYPES, CausalLM
from .output_processor import OutputProcessor
from .outputs import EngineStats, RequestMetrics, RequestOutput
from .parallel import shard
from .parallel.executor import TensorParallelExecutor
from .parallel.group import ParallelGroup
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scheduler_output import GrammarBitmask, SchedulerOutput
from .spec_decode import Proposer
from .spec_draft import check_tokenizers, draft_folder
from .structured import GrammarCompiler, grammar_bitmask
from .tokenizer import Tokenizer

__all__ = ["EngineStats", "LLMEngine", "RequestMetrics", "RequestOutput"]

_DEFAULT_CPU_KV_BYTES = 512 * 1024 * 1024

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


def _dtypes(name: str, device: torch.device, folder: Path) -> tuple[torch.dtype, torch.dtype | None]:
    """(activations' dtype, the projections' GEMM dtype or None for the same) of a `dtype` setting.
    bfloat16 on a CPU where oneDNN runs it is CPU autocast's split: bfloat16 weights and GEMMs (twice
    float32's rate with AVX-512 BF16), float32 activations, norms, attention and KV cache (so the
    compiled kernels serve it too): 1.6x float32's decode step on SmolLM2-135M (docs/llm.md).
    "auto" is that for a checkpoint stored in bfloat16 on such a CPU (as vLLM's CPU default keeps a
    bfloat16 checkpoint's dtype), float32 for every other checkpoint and device."""
    if name == "auto":
        try:
            raw = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            raw = {}
        stored = (raw.get("dtype") or raw.get("torch_dtype")) if isinstance(raw, dict) else None
        name = "bfloat16" if stored == "bfloat16" and onednn_available(torch.bfloat16, device) else "float32"
    if name == "bfloat16" and onednn_available(torch.bfloat16, device):
        return torch.float32, torch.bfloat16
    return DTYPES[name], None


def _device(cfg: ParallelConfig, rank: int = 0) -> torch.device:
    """The configured device; under tensor parallelism on CUDA, rank r's is `cuda:<r on its machine>`
    (one GPU per rank, `local_ranks` ranks on each machine)."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    n = cfg.local_ranks
    if device.type != "cuda" or cfg.tensor_parallel_size == 1:
        return device
    if torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size {cfg.tensor_parallel_size} on {cfg.nnodes} machine(s) needs {n} "
                         f"CUDA devices on each (one per rank), this machine has {torch.cuda.device_count()}")
    return torch.device("cuda", rank % n)


def _kv_budget(cfg: CacheConfig, device: torch.device) -> int:
    """KV bytes (per rank under tensor parallelism, as vLLM's are per device)."""
    if cfg.kv_cache_memory_bytes is not None:
        return cfg.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(int(total * cfg.gpu_memory_utilization) - used, 0)
    return _DEFAULT_CPU_KV_BYTES


def build_runner(folder: Path, cfg: EngineConfig, model_cls: type[CausalLM], mc: ArchConfig, device: torch.device,
                 max_model_len: int, eos_ids: tuple[int, ...], progress: Callable[[LoadProgress], None] | None,
                 group: ParallelGroup | None = None) -> ModelRunner:
    """The model (this rank's shard of it, with `group`) loaded, its KV caches and the compiled CPU
    kernels where they serve: what every rank builds alike."""
    model, cache, spec = cfg.model, cfg.cache, cfg.scheduler.speculative_config
    dtype, gemm = _dtypes(model.dtype, device, folder)
    prepare = None if group is None else (lambda m: shard.shard_model(m, group))
    quant = registry.resolve_quantization(folder, model.quantization)
    draft = None  # speculative decoding's draft model: same tokenizer, same dtype and device
    # its shape alone: tensor parallelism runs the draft model (whole) on rank 0 only, and the other
    # ranks budget its KV blocks alike, so that every rank has the same number of blocks
    draft_shape: CausalLM | None = None
    found_scales: dict[int, dict[str, float]] = {}  # the checkpoint's KV cache scales (kv_fp8.py)
    with gemm_dtype(gemm):
        lm = registry.load_model(folder, model_cls, mc, dtype, device, max_model_len + 1, progress, prepare, quant,
                                 found_scales)
        if spec is not None and spec.model is not None:
            dfolder = draft_folder(spec.model, folder)
            check_tokenizers(folder, dfolder)
            draft_cls, draft_mc = registry.resolve(dfolder)
            if group is None or group.first:
                draft = draft_shape = registry.load_model(dfolder, draft_cls, draft_mc, dtype, device,
                                                          max_model_len + 1, progress)
            else:
                draft_shape = draft_cls(draft_mc, dtype, device, max_model_len + 1)  # type: ignore[call-arg]
    kv_dtype = kv_fp8.cache_dtype(cache.kv_cache_dtype)  # None: the model's dtype
    kv_scales = None if kv_dtype is None else kv_fp8.layer_scales(len(lm.kv_cache_specs()), found_scales)
    # an FP8 cache is the served model's; a draft model keeps its caches in the model's dtype
    per_block = kv_bytes_per_block(lm, cache.block_size, kv_dtype) + (
        0 if draft_shape is None else kv_bytes_per_block(draft_shape, cache.block_size))
    num_blocks = _kv_budget(cache, device) // per_block
    num_cpu = cache.swap_space_bytes // per_block if cfg.scheduler.preemption_mode == "swap" else 0
    ops = None
    if (model.attention == "auto" and device.type == "cpu" and dtype == torch.float32
            and cache.block_size <= 64 and mc.head_dim % 4 == 0
            and (draft_shape is None or draft_shape.config.head_dim % 4 == 0)):
        if progress is not None:
            progress(LoadProgress("building the CPU kernels (compiled once, then cached)"))
        ops = kernels.load()
    if ops is not None:
        for m in (lm, draft):
            if m is not None:
                m.use_kernels(ops)
    return ModelRunner(lm, cache.block_size, num_blocks, num_cpu, eos_ids,
                       None if ops is None else ops.paged_decode_attention, draft, kv_dtype, kv_scales)


class LLMEngine:
    """The synchronous engine. Not thread-safe: call it from one thread."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 progress: Callable[[LoadProgress], None] | None = None, socket_folder: str | None = None) -> None:
        """`progress` hears how the load goes (weights shard by shard, the kernels' build);
        `socket_folder`: where a tensor-parallel rank 0 binds its sockets to the other ranks (the
        engine core's private folder; None: a scratch folder of its own)."""
        self.config = config or EngineConfig()
        cfg = self.config
        model, cache, sched, par = cfg.model, cfg.cache, cfg.scheduler, cfg.parallel
        folder = Path(model.model_path or model_dir)
        model_cls, self.model_config = registry.resolve(folder)
        self.quant = registry.resolve_quantization(folder, model.quantization)  # what the weights run as
        self.tokenizer = Tokenizer(folder)
        mc = self.model_config
        self.max_model_len = min(model.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.device = _device(par)
        threads = par.num_threads or (max(1, torch.get_num_threads() // par.tensor_parallel_size)
                                      if par.tensor_parallel_size > 1 else None)
        if threads is not None:
            torch.set_num_threads(threads)
        self.eos_ids = tuple(mc.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        spec = sched.speculative_config
        self.executor: TensorParallelExecutor | None = None
        group = None
        if par.tensor_parallel_size > 1:
            shard.check(mc, par.tensor_parallel_size)  # before any rank starts
            group = ParallelGroup(0, par.tensor_parallel_size, self.device)
            self.executor = TensorParallelExecutor(folder, cfg, group, self.eos_ids, threads, self.max_model_len,
                                                   socket_folder, progress)
        try:
            self.runner = build_runner(folder, cfg, model_cls, mc, self.device, self.max_model_len, self.eos_ids,
                                       progress, group)
            if self.executor is not None:
                self.executor.connect(self.runner)  # every rank has loaded its shard: join the group
        except BaseException:
            self.close()
            raise
        self.model = self.runner.model
        num_blocks = self.runner.num_blocks
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, self.runner.num_cpu_blocks,
                                 self.runner.kv_windows)
        fits = max_seq_tokens(self.kv.windows, num_blocks, cache.block_size, sched.max_num_batched_tokens)
        self.max_model_len = self.max_model_len if fits is None else min(self.max_model_len, fits)
        self.execute = self.runner.execute if self.executor is None else self.executor.execute
        self.lora: LoRAManager | None = None
        if cfg.lora.enable_lora:  # the projections get the LoRA method; the runner sets its rows each step
            self.runner.lora = LoRABatch()
            self.lora = LoRAManager(self.model, cfg.lora, self.runner.lora, record=self.executor is not None)
            if self.executor is not None:  # the other ranks install and evict as rank 0 does, step by step
                self.executor.lora_ops = self.lora.take_ops
            for module in cfg.lora.lora_modules:  # a bad one fails the load, naming it
                self.lora.add(module.name, Path(module.path), module.base_model_name)
        self.scheduler = Scheduler(cfg, self.kv, None if spec is None else Proposer(spec, self.max_model_len).propose)
        self.grammars = GrammarCompiler(self.tokenizer.json, mc.vocab_size, self.eos_ids)
        self.generation_defaults = _generation_defaults(folder) if model.generation_config == "auto" else {}
        self.inputs = InputProcessor(self.tokenizer, self.grammars, self.max_model_len, mc.vocab_size,
                                     sched.max_num_seqs, sched.scheduling_policy == "priority")
        self.outputs = OutputProcessor(self.tokenizer, self.grammars, self.scheduler, self.kv, self.eos_ids,
                                       self.max_model_len)
        self._requests = self.outputs.requests  # request id -> its sequences
        self._prompt_tokens = 0
        self._peak_blocks = 0

    @classmethod
    def from_parameters(cls, model_dir: str | Path, parameters: Mapping[str, str],
                        progress: Callable[[LoadProgress], None] | None = None, **overrides: object) -> LLMEngine:
        """Build from a model config's `parameters` map (strings). Raises ValueError on bad values."""
        return cls(model_dir, EngineConfig.from_parameters(parameters, **overrides), progress)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank); idempotent."""
        if self.executor is not None:
            self.executor.close()

    def failure(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel rank died), or None."""
        return None if self.executor is None else self.executor.failure

    # -- requests -------------------------------------------------------------------------------

    def check_text_length(self, text: str) -> None:
        check_text_length(text, self.max_model_len)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return self.inputs.encode_prompt(prompt)

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (bad prompt or parameters, duplicate id)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params = params or SamplingParams()
        self.inputs.check(params)
        ids = self.inputs.encode_prompt(prompt)
        lora_id = self._lora_id(params.lora_name)
        seq = self.outputs.new_seq(request_id, 0, ids, params, arrival_time or time.monotonic())
        seq.pending_forks = params.n - 1
        seq.lora_id = lora_id
        self._requests[request_id] = [seq]
        self._prompt_tokens += len(ids)
        self.scheduler.add(seq)

    def _lora_id(self, name: str | None) -> int:
        if name is None:
            return 0
        if self.lora is None:
            raise ValueError("LoRA feature is not enabled.")
        return self.lora.resolve(name)

    # -- LoRA adapters (lora.py) -----------------------------------------------------------------

    def load_lora(self, name: str, path: str | Path, inplace: bool = False) -> Adapter:
        """Serve the PEFT adapter at `path` as `name`. Raises lora.LoRAError (its `status`: 400, or 404
        for no adapter there), ValueError when LoRA is off."""
        if self.lora is None:
            raise ValueError("LoRA feature is not enabled.")
        return self.lora.add(name, Path(path), inplace=inplace)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`; KeyError when it is not served."""
        if self.lora is None:
            raise KeyError(name)
        self.lora.remove(name)

    def update_lora(self, name: str, path: str | None, inplace: bool = False) -> tuple[int, str]:
        """vLLM's /v1/load_lora_adapter (`path` given) or /v1/unload_lora_adapter: (HTTP status, text)."""
        from .lora import LoRAError

        if path is None:
            try:
                self.unload_lora(name)
            except KeyError:
                return 404, f"The lora adapter '{name}' cannot be found."
            return 200, f"Success: LoRA adapter '{name}' removed successfully."
        try:
            self.load_lora(name, path, inplace)
        except LoRAError as exc:
            return exc.status, str(exc)
        except ValueError as exc:
            return 400, str(exc)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def lora_adapters(self) -> dict[str, str]:
        """The adapters served: name -> folder."""
        return {} if self.lora is None else {a.name: str(a.path) for a in self.lora.adapters.values()}

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request: its blocks are freed now. Returns its final "abort" outputs (empty if unknown)."""
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model and sample, and report what each touched sequence produced."""
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        self._peak_blocks = max(self._peak_blocks, self.kv.pool.num_blocks - self.kv.pool.num_free)
        if self.lora is not None:
            in_use = {s.lora_id for seqs in self._requests.values() for s in seqs if not s.finished}
            self.lora.activate({s.lora_id for s in so.scheduled if s.lora_id}, in_use)
        out = self.execute(so, self._grammar_bitmask(so))
        outs = self.outputs.process(so, out)
        for s in so.scheduled:
            if s.draft_token_ids and (seq := self.outputs.running(s.seq_id)) is not None:
                self.scheduler.rollback(seq)  # the rejected drafts' KV goes back
        return outs

    def _grammar_bitmask(self, so: SchedulerOutput) -> GrammarBitmask | None:
        """What each sampling sequence's grammar allows now (structured output), computed here, where
        the grammars are, and shipped with the step."""
        seqs = [seq for s in so.scheduled if s.sample and (seq := self.outputs.seq(s.seq_id)).matcher is not None]
        if not seqs:
            return None
        return GrammarBitmask([s.seq_id for s in seqs], grammar_bitmask([s.matcher for s in seqs],
                                                                        self.model_config.vocab_size))

    # -- introspection --------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes; False while a request holds blocks (see BlockPool)."""
        return self.kv.pool.reset_prefix_cache()

    def cache_config_info(self) -> dict[str, str]:
        """vllm:cache_config_info's labels (fixed settings: safe from any thread), so that
        inference gateways read the KV capacity (num_gpu_blocks x block_size) as from vLLM."""
        cfg = self.config.cache
        return {"block_size": str(cfg.block_size), "cache_dtype": cfg.kv_cache_dtype,
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
                "kv_cache_memory_bytes": str(cfg.kv_cache_memory_bytes),
                # tokens of context the pool holds when each KV cache group keeps every block (kv_groups.py)
                "kv_cache_size_tokens": str(self.kv.pool.num_blocks // len(self.kv.windows) * cfg.block_size),
                "num_cpu_blocks": str(self.kv.cpu_pool.num_blocks), "num_gpu_blocks": str(self.kv.pool.num_blocks),
                # what the weights run as (vLLM keeps this in its model config; here beside the cache's)
                "quantization": "none" if self.quant is None else self.quant.method,
                "weight_bits": "none" if self.quant is None else str(self.quant.bits),
                "weight_types": "none" if self.quant is None or not self.quant.types else self.quant.types}

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        running, waiting = self._lora_stats()
        return EngineStats(
            num_running=s["running"], num_waiting=s["waiting"], num_swapped=s["swapped"],
            kv_cache_usage=self.kv.pool.usage(), prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=s["preemptions"],
            prompt_tokens=self._prompt_tokens, generation_tokens=self.outputs.generation_tokens,
            num_blocks=self.kv.pool.num_blocks, peak_blocks_used=self._peak_blocks,
            spec_decode=None if self.config.scheduler.speculative_config is None else self.runner.spec_stats.copy(),
            lora_running=running, lora_waiting=waiting,
            kv_cache_fp8_clamped=None if self.runner.kv_scales is None else self.runner.kv_clamped,
        )

    def _lora_stats(self) -> tuple[list[str], list[str]]:
        """The adapters (names) of the running requests, and of those waiting or swapped out."""
        if self.lora is None:
            return [], []
        sched, name = self.scheduler, self.lora.name_of
        return (sorted({name(s.lora_id) for s in sched.running if s.lora_id}),
                sorted({name(s.lora_id) for s in [*sched.waiting, *sched.swapped] if s.lora_id}))

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
