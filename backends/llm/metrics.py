"""The LLM backend's Prometheus metrics, with vLLM's names, so that vLLM's Grafana dashboard and
inference gateways read Pier as they read vLLM: engine gauges and counters, and the latency and
request-level histograms the backend observes as it streams."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from pier.contract import prometheus

if TYPE_CHECKING:  # the engine imports torch: only its stats type is needed here
    from pier.backends.llm.engine import EngineStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


_N_BUCKETS = (1, 2, 5, 10, 20)


def _one_two_five(limit: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
            self.counts[i] += 1
            self.total += value
            self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        with self.lock:
            return prometheus.histogram(name, labels, self.buckets, self.counts, self.total, self.n, bound_text=str,
                                        sum_text=str)



def phase_times(m: Any) -> dict[str, float] | None:
    """A finished sequence's phases (its RequestMetrics) in seconds, vLLM's names (pier.contract.llm
    TIMINGS): queue and inference, and prefill and decode once a token came; None before it was
    scheduled."""
    if m is None or m.first_scheduled_time is None:
        return None
    end = m.finished_time or m.last_token_time or m.first_scheduled_time
    out = {"time_in_queue": m.first_scheduled_time - m.arrival_time,
           "time_in_model_inference": end - m.first_scheduled_time}
    if m.first_token_time is not None:
        out["time_in_model_prefill"] = m.first_token_time - m.first_scheduled_time
        out["time_in_model_decode"] = (m.last_token_time or m.first_token_time) - m.first_token_time
    return out


class LLMMetrics:
    """One LLM instance's metrics. The histograms are thread-safe; the request counters are
    written on the server's loop only."""

    def __init__(self, max_model_len: int) -> None:
        self.ttft = _Histogram(_TTFT_BUCKETS)
        self.itl = _Histogram(_ITL_BUCKETS)
        self.e2e = _Histogram(_E2E_BUCKETS)
        tokens = _one_two_five(max_model_len)
        # per finished sequence, as vLLM's request-level histograms (name -> (help, histogram))
        self.per_request = {
            "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                                _Histogram(_E2E_BUCKETS)),
            "vllm:request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.",
                                                    _Histogram(_E2E_BUCKETS)),
            "vllm:request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                                  _Histogram(_E2E_BUCKETS)),
            "vllm:request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                                 _Histogram(_E2E_BUCKETS)),
            "vllm:request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                                           _Histogram(_ITL_BUCKETS)),
            "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", _Histogram(tokens)),
            "vllm:request_generation_tokens": ("Number of generation tokens processed.", _Histogram(tokens)),
            "vllm:request_params_max_tokens": ("Histogram of the max_tokens request parameter.", _Histogram(tokens)),
            "vllm:request_params_n": ("Histogram of the n request parameter.", _Histogram(_N_BUCKETS)),
        }
        self.requests_ok = 0
        self.requests_aborted = 0

    def observe_finished(self, out: Any, sampling: Any) -> None:
        """vLLM's request-level histograms, for a sequence that finished (not aborted); the request's
        parameters once, with its first sequence."""
        h = {name: hist for name, (_, hist) in self.per_request.items()}
        if out.index == 0:
            h["vllm:request_params_n"].observe(sampling.n)
            if sampling.max_tokens is not None:
                h["vllm:request_params_max_tokens"].observe(sampling.max_tokens)
        h["vllm:request_prompt_tokens"].observe(out.prompt_tokens)
        h["vllm:request_generation_tokens"].observe(out.completion_tokens)
        phases = phase_times(out.metrics)
        if phases is None:
            return
        h["vllm:request_queue_time_seconds"].observe(phases["time_in_queue"])
        h["vllm:request_inference_time_seconds"].observe(phases["time_in_model_inference"])
        if "time_in_model_decode" in phases:
            h["vllm:request_prefill_time_seconds"].observe(phases["time_in_model_prefill"])
            h["vllm:request_decode_time_seconds"].observe(phases["time_in_model_decode"])
            if out.completion_tokens > 1:
                h["vllm:request_time_per_output_token_seconds"].observe(
                    phases["time_in_model_decode"] / (out.completion_tokens - 1))

    def render(self, s: EngineStats, model: str, cache_info: dict[str, str] | None = None, max_loras: int = 0) -> str:
        """The vllm:* families, vLLM's names and help texts, for the engine stats `s` (and the KV
        cache's settings, vllm:cache_config_info's labels; with LoRA on, `max_loras`)."""
        labels = f'model_name="{model}"'
        parts: list[str] = []

        def family(name: str, kind: str, help_text: str, rows: list[str]) -> None:
            parts.append(prometheus.family(name, kind, help_text, rows))

        if cache_info is not None:
            info = ",".join(f'{k}="{v}"' for k, v in sorted({**cache_info, "engine": "0"}.items()))
            family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
                   [f"vllm:cache_config_info{{{info},{labels}}} 1.0\n"])

        for name, help_text, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:num_requests_swapped", "Number of requests swapped to CPU.", s.num_swapped),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        ):
            family(name, "gauge", help_text, [f"{name}{{{labels}}} {value}\n"])
        for name, help_text, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens),
        ):
            family(name, "counter", help_text, [f"{name}_total{{{labels}}} {value}\n"])
        if s.spec_decode is not None:  # vLLM's spec_decode counters (with a speculative_config)
            sd = s.spec_decode
            for name, help_text, value in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", sd.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", sd.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", sd.num_accepted_tokens),
            ):
                family(name, "counter", help_text, [f"{name}_total{{{labels}}} {value}\n"])
            name = "vllm:spec_decode_num_accepted_tokens_per_pos"
            family(name, "counter", "Accepted tokens per draft position.",
                   [f'{name}_total{{{labels},position="{i}"}} {v}\n' for i, v in enumerate(sd.accepted_per_pos)])
        if s.kv_cache_fp8_clamped is not None:  # Pier's own: an FP8 KV cache's clamped values (kv_fp8.py)
            name = "pier_llm_kv_cache_fp8_clamped_values"
            family(name, "counter", "K/V values clamped to the FP8 KV cache's range when stored (a scale too small).",
                   [f'{name}_total{{model="{model}"}} {s.kv_cache_fp8_clamped}\n'])
        family("vllm:request_success", "counter", "Count of successfully processed requests.",
               [f'vllm:request_success_total{{{labels},finished_reason="finished"}} {self.requests_ok}\n',
                f'vllm:request_success_total{{{labels},finished_reason="abort"}} {self.requests_aborted}\n'])
        for name, help_text, hist in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e),
        ):
            family(name, "histogram", help_text, hist.render(name, labels))
        for name, (help_text, hist) in self.per_request.items():
            family(name, "histogram", help_text, hist.render(name, labels))
        if max_loras:  # exactly vLLM's: no model_name label, names joined by "," and the time as the value
            lora = (f'max_lora="{max_loras}",running_lora_adapters="{",".join(s.lora_running)}",'
                    f'waiting_lora_adapters="{",".join(s.lora_waiting)}"')
            family("vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
                   [f"vllm:lora_requests_info{{{lora}}} {time.time()}\n"])
        return "".join(parts)
