"""Engine settings, parsed once from the model config's `parameters` map (all strings).

Grouped as vLLM's VllmConfig groups them: `ModelConfig` (what runs and how it answers),
`CacheConfig` (the paged KV cache), `SchedulerConfig` (what runs together), `ParallelConfig` (where
the engine runs: the device, its threads, its own process or a thread, its tensor-parallel ranks),
`LoRAConfig` (multi-LoRA). Each part is handed to the component that needs it. The config.pbtxt
parameters stay flat (vLLM's engine arguments are too): `EngineConfig(block_size=8, ...)` and
`from_parameters` route each setting to its group, and `config.block_size` reads it from there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pier.contract.backend import MAX_THREADS

from .spec_decode import SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
_PREEMPTION_MODES = ("recompute", "swap")
_ATTENTION = ("auto", "torch")
# vLLM's kv_cache_dtype values: "auto" (the model's dtype), or an FP8 cache (kv_fp8.py; "fp8" = E4M3)
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_QUANTIZATION = ("int8", "gptq", "awq", "compressed-tensors", "gguf", "fp8")  # models/quantization.METHODS


@dataclass(frozen=True)
class ModelConfig:
    """The model as served: its folder (None: the version folder), dtype, context and answer defaults."""

    model_path: Path | None = None
    # "auto": bfloat16 for a bfloat16 checkpoint on CPU (engine._dtypes: bfloat16 GEMMs on float32
    # activations, 1.6x float32's decode step), float32 otherwise. A served model's default
    # (`from_parameters`, as vLLM's --dtype auto); an EngineConfig built in code keeps float32.
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own limit
    # "auto": the model folder's generation_config.json supplies sampling defaults (temperature,
    # top_p, top_k, min_p, repetition_penalty) and max_new_tokens as the default max_tokens, as
    # vLLM's --generation-config auto; "vllm": ignore it.
    generation_config: str = "auto"
    max_tokens_cap: int | None = None  # the most max_tokens a request may ask for (more is a 400)
    # "auto": the compiled CPU kernels (decode attention, RMSNorm, SiLU * up, RoPE + K/V write) on
    # CPU in float32 (built on first use, see kernels.py), the torch path otherwise; "torch": always torch.
    attention: str = "auto"
    seed: int = 0
    # vLLM's `quantization`: "int8" quantizes an unquantized checkpoint's decoder projections at load;
    # a quantized checkpoint's method (gptq, awq, compressed-tensors) runs without it, and naming
    # another is refused (models/quantization.py). None: the checkpoint's own, if any.
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("max_tokens_cap must be at least 1")
        if self.attention not in _ATTENTION:
            raise ValueError(f"attention must be 'auto' or 'torch', got {self.attention!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.quantization is not None and self.quantization not in _QUANTIZATION:
            raise ValueError(f"quantization must be one of {', '.join(_QUANTIZATION)}, got {self.quantization!r}")


@dataclass(frozen=True)
class CacheConfig:
    """KV memory: `kv_cache_memory_bytes` wins when set; otherwise on CUDA the pool takes
    `gpu_memory_utilization` of the device memory minus what the weights use, and on CPU a default
    of 512 MiB. `swap_space_bytes`: the CPU area preemption_mode "swap" copies blocks to."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 0
    kv_cache_dtype: str = "auto"  # vLLM's setting; vllm:cache_config_info's cache_dtype label shows it

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(_KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.swap_space_bytes < 0:
            raise ValueError("swap_space_bytes must be non-negative")


@dataclass(frozen=True)
class SchedulerConfig:
    """`max_num_batched_tokens` is the per-step token budget (prefill chunks plus one token per decode)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # "fcfs": first come, first served; "priority": requests' `priority` first (lower value first,
    # ties by arrival), and the preemption victim is the lowest priority, latest arrival (vLLM's).
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    # vLLM's speculative_config (JSON; spec_decode.py): n-gram drafts verified K + 1 positions a pass
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class ParallelConfig:
    """Where the engine runs."""

    device: str = "auto"  # "auto": cuda when available, else cpu; or "cpu", "cuda", "cuda:1"
    num_threads: int | None = None  # torch intra-op threads for the engine (None: leave torch's setting)
    # "process": the engine steps in a process of its own (engine_core.py; the server keeps HTTP,
    # gRPC, tokenization and streaming), so the two do not share one interpreter lock, and a crash
    # of the engine takes down only this model; "thread": on a thread of the server's process.
    engine_core: str = "process"
    # vLLM's name: the model split over this many ranks (processes), Megatron-style (parallel/); the
    # engine-core process is rank 0 and starts the others. `num_threads`, when set, is per rank; unset,
    # each rank takes an equal share of the machine's threads.
    tensor_parallel_size: int = 1
    # Several machines (vLLM's names, parallel/remote.py): the group spans `nnodes` machines, N / nnodes
    # ranks each; this server's machine runs ranks 0..N/nnodes-1 and waits for the others to join
    # (`pier tp-worker`) at master_addr: the torch.distributed store on master_port, the step channel
    # on master_port + 1, for `distributed_timeout_seconds` (None: 600 s) before its load fails.
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    distributed_timeout_seconds: int | None = None

    @property
    def local_ranks(self) -> int:
        """How many ranks run on this server's machine (rank 0 and its children)."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def join_timeout_s(self) -> float:
        return float(self.distributed_timeout_seconds or 600)

    def __post_init__(self) -> None:
        if self.engine_core not in ("process", "thread"):
            raise ValueError(f"engine_core must be 'process' or 'thread', got {self.engine_core!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.engine_core != "process":
            raise ValueError("tensor_parallel_size > 1 needs engine_core 'process': the engine-core process is "
                             "rank 0 of the group (a server process cannot be a rank)")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must be at least 1 and divide tensor_parallel_size "
                             f"({self.tensor_parallel_size}): each machine runs as many ranks")
        if not 1 <= self.master_port <= 65534:
            raise ValueError(f"master_port must be between 1 and 65534 (the step channel is on master_port + 1), "
                             f"got {self.master_port}")
        if not self.master_addr:
            raise ValueError("master_addr must name this machine's address the other machines reach")
        if self.distributed_timeout_seconds is not None and self.distributed_timeout_seconds < 1:
            raise ValueError(f"distributed_timeout_seconds must be at least 1, got {self.distributed_timeout_seconds}")
        if self.num_threads is not None and not 1 <= self.num_threads <= MAX_THREADS:
            raise ValueError(f"num_threads must be between 1 and {MAX_THREADS}")


# vLLM's allowed --max-lora-rank values
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter to serve: vLLM's LoRAModulePath (`--lora-modules`)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(text: str) -> tuple[LoRAModulePath, ...]:
    """vLLM's `lora_modules` forms: a JSON list of (or one) {"name", "path", "base_model_name"}, or
    space-separated `name=path` pairs. ValueError naming what is wrong."""
    text = text.strip()
    if not text:
        return ()
    if text[0] in "[{":
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"lora_modules is not valid JSON: {exc}") from None
        items = doc if isinstance(doc, list) else [doc]
        out = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"] \
                    or not isinstance(item.get("path"), str) or not item["path"]:
                raise ValueError(f"lora_modules: each entry needs a \"name\" and a \"path\", got {item!r}")
            base = item.get("base_model_name")
            out.append(LoRAModulePath(item["name"], item["path"], base if isinstance(base, str) else None))
        return tuple(out)
    pairs = []
    for word in text.split():
        name, sep, path = word.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {word!r} is not name=path")
        pairs.append(LoRAModulePath(name, path))
    return tuple(pairs)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (lora.py), vLLM's engine arguments: `max_loras` distinct adapters in one step (the
    other requests wait), `max_lora_rank` the largest rank accepted, `max_cpu_loras` adapters kept
    loaded (LRU; None: max_loras), `lora_modules` the adapters served from the start (absolute
    paths: the backend resolves them)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[LoRAModulePath, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank ({self.max_lora_rank}) must be one of {', '.join(map(str, LORA_RANKS))}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


_GROUPS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                            "parallel": ParallelConfig, "lora": LoRAConfig}
# The names adapter models' versions (adapter_model.py) run under in their base's engine: not listed
# as the base's adapters (the adapter model is listed under its own name)
INTERNAL_PREFIX = "pier-adapter-model:"
_GROUP_OF = {f.name: group for group, cls in _GROUPS.items() for f in fields(cls)}


def engine_settings() -> frozenset[str]:
    """The config.pbtxt parameters the engine reads (an adapter model, which runs on its base's
    engine, refuses them)."""
    return frozenset(_GROUP_OF)


class EngineConfig:
    """Everything the engine needs besides the model folder: its groups (vLLM's VllmConfig).

    Built from flat settings (`EngineConfig(block_size=8, dtype="float32")`; TypeError for a name no
    group has) or from the groups; a flat name reads through to its group. Immutable."""

    __slots__ = tuple(_GROUPS)
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    lora: LoRAConfig

    def __init__(self, model: ModelConfig | None = None, cache: CacheConfig | None = None,
                 scheduler: SchedulerConfig | None = None, parallel: ParallelConfig | None = None,
                 lora: LoRAConfig | None = None, **settings: Any) -> None:
        given = {"model": model, "cache": cache, "scheduler": scheduler, "parallel": parallel, "lora": lora}
        unknown = sorted(set(settings) - set(_GROUP_OF))
        if unknown:
            raise TypeError(f"unknown engine settings: {', '.join(unknown)}")
        for group, cls in _GROUPS.items():
            mine = {k: v for k, v in settings.items() if _GROUP_OF[k] == group}
            value = given[group]
            if value is None:
                value = cls(**mine)
            elif mine:
                raise TypeError(f"{', '.join(mine)} given both flat and in {group}")
            object.__setattr__(self, group, value)

    def __getattr__(self, name: str) -> Any:
        group = _GROUP_OF.get(name)
        if group is None:
            raise AttributeError(f"EngineConfig has no setting {name!r}")
        return getattr(getattr(self, group), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("EngineConfig is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return EngineConfig, tuple(getattr(self, g) for g in _GROUPS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineConfig) and all(getattr(self, g) == getattr(other, g) for g in _GROUPS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, g) for g in _GROUPS))

    def __repr__(self) -> str:
        return f"EngineConfig({', '.join(f'{g}={getattr(self, g)!r}' for g in _GROUPS)})"

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], **overrides: object) -> EngineConfig:
        """Parse the config.pbtxt `parameters` map; unknown keys are ignored (other layers own them).

        Raises ValueError naming the parameter on a bad value.
        """
        kwargs: dict[str, Any] = {}
        for name, raw in params.items():
            if name not in _GROUP_OF:
                continue
            text = str(raw).strip()
            if name == "lora_modules":
                kwargs[name] = parse_lora_modules(text)
                continue
            if name == "speculative_config":  # its own messages name the bad field
                try:
                    kwargs[name] = SpeculativeConfig.from_json(text)
                except ValueError as exc:
                    raise ValueError(f"parameter {exc}") from None
                continue
            try:
                kwargs[name] = _parse(name, text)
            except ValueError:
                raise ValueError(f"parameter {name}: invalid value {raw!r}") from None
        kwargs.setdefault("dtype", "auto")  # served: a bfloat16 checkpoint runs CPU bfloat16, as vLLM's default
        kwargs.update(overrides)
        return cls(**kwargs)


def _parse(name: str, text: str) -> object:
    if name in ("model_path",):
        return Path(text) if text else None
    if name in ("dtype", "device", "preemption_mode", "attention", "scheduling_policy", "generation_config",
                "engine_core", "kv_cache_dtype"):
        return text.lower()
    if name == "master_addr":
        return text
    if name in ("enable_prefix_caching", "enable_lora"):
        low = text.lower()
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError
        return low in ("true", "1", "yes")
    if name == "gpu_memory_utilization":
        return float(text)
    if name in ("kv_cache_memory_bytes", "swap_space_bytes"):
        return int(float(text))
    if name == "quantization":
        return text.lower() or None
    if name in ("max_model_len", "num_threads", "max_tokens_cap", "max_cpu_loras",
                "distributed_timeout_seconds"):
        return int(text) if text else None
    return int(text)
