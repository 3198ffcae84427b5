"""What a step hands back: the model runner's `ModelRunnerOutput` (to the engine), and the engine's
`RequestOutput` and `EngineStats` (to its callers: the async client, the engine-core process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .spec_decode import SpecDecodeStats

SampleLogprobs = tuple[float, dict[int, float] | None]  # the chosen token's logprob, the top alternatives


@dataclass
class PromptLogprobs:
    """One prompt chunk's logprobs: entry j is for prompt position `first_position + j` (the token
    there, under the model's distribution after the tokens before it)."""

    first_position: int
    logprobs: list[float]
    top: list[dict[int, float]] | None  # the prompt_logprobs best alternatives per position, when k > 0


@dataclass
class ModelRunnerOutput:
    """One step's results (vLLM's ModelRunnerOutput). Entry i of the three lists belongs to
    `seq_ids[i]`; a row that forks (n > 1) is followed by its children's entries."""

    seq_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)  # for sequences that asked for them
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # embed requests: final hidden state, L2-normalised


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
    spec_decode: SpecDecodeStats | None = None  # vllm:spec_decode_* (with speculative_config)
    # vllm:lora_requests_info: the adapters of the running and of the waiting requests (names, sorted)
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    kv_cache_fp8_clamped: int | None = None  # pier_llm_kv_cache_fp8_clamped_values_total (None: no FP8 cache)
    extra: dict[str, float] = field(default_factory=dict)
