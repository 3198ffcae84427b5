"""Every Prometheus metric Pier exports, with Triton's names and labels, rendered at scrape time
from the same per-version counters the statistics extension reports.

The text is written here rather than through prometheus_client's counters because Triton's
counter names carry no `_total` suffix and existing dashboards query them as they are;
prometheus_client still supplies the process_* / python_* families.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import prometheus_client

from pier.contract.prometheus import family, histogram
from pier.dataplane.response_cache import ResponseCache
from pier.lifecycle.loaded_model import LoadedModel
from pier.observability.statistics import FAILURE_REASONS, HISTOGRAM_BUCKETS_MS, Duration

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# Triton's default summary quantiles (quantile: allowed error, the error unused here: exact).
DEFAULT_QUANTILES = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.0001))
SUMMARY_WINDOW_S = 60.0  # quantiles over the last minute, as prometheus-cpp's summary default


@dataclass(frozen=True)
class MetricsConfig:
    """`--metrics-config` keys, as tritonserver spells them."""

    counter_latencies: bool = True
    histogram_latencies: bool = False
    summary_latencies: bool = False
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES

    @classmethod
    def parse(cls, items: Iterable[str]) -> MetricsConfig:
        values: dict[str, object] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if key == "summary_quantiles" and sep:
                values[key] = _quantiles(value)
                continue
            if not sep or key not in ("counter_latencies", "histogram_latencies", "summary_latencies"):
                raise ValueError(f"unsupported --metrics-config '{item}' (known: counter_latencies, "
                                 "histogram_latencies, summary_latencies, each =true or =false, and "
                                 "summary_quantiles=<q>:<error>,...)")
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--metrics-config {key} must be true or false, got '{value}'")
            values[key] = value.lower() in ("true", "1")
        return cls(**values)  # type: ignore[arg-type]


def _quantiles(text: str) -> tuple[tuple[float, float], ...]:
    out = []
    for part in text.strip().strip('"').split(","):
        q, sep, err = part.partition(":")
        try:
            pair = (float(q), float(err) if sep else 0.0)
        except ValueError:
            raise ValueError(f"--metrics-config summary_quantiles: '{part}' is not <quantile>:<error>") from None
        if not 0.0 <= pair[0] <= 1.0:
            raise ValueError(f"--metrics-config summary_quantiles: quantile {pair[0]} is outside [0, 1]")
        out.append(pair)
    return tuple(out)


def _labels(model: LoadedModel, extra: str = "") -> str:
    """model, [namespace (--model-namespacing: its repository),] [extra,] version: prometheus-cpp's
    sorted order, as Triton exports them."""
    namespace = f',namespace="{model.namespace}"' if model.namespace else ""
    return f'model="{model.spec.name}"{namespace}{extra},version="{model.version_str}"'


def _reason(reason: str) -> str:
    return f',reason="{reason}"'


_COUNTERS: tuple[tuple[str, str, Callable[[LoadedModel], int]], ...] = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     lambda m: m.stats.success.count),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     lambda m: m.stats.inference_count),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     lambda m: m.stats.execution_count),
)
_CACHED = " (includes cached requests)"
_NOT_CACHED = " (does not include cached requests)"
# (counter name, its help, summary name, its help, the stage) with Triton's texts, word for word.
_STAGE_METRICS: tuple[tuple[str, str, str, str, str], ...] = (
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds" + _CACHED,
     "nv_inference_request_summary_us", "Summary of inference request duration in microseconds" + _CACHED,
     "success"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds" + _CACHED,
     "nv_inference_queue_summary_us", "Summary of inference queuing duration in microseconds" + _CACHED, "queue"),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds" + _NOT_CACHED,
     "nv_inference_compute_input_summary_us", "Cumulative compute input duration in microseconds" + _NOT_CACHED,
     "compute_input"),
    ("nv_inference_compute_infer_duration_us",
     "Cumulative compute inference duration in microseconds" + _NOT_CACHED,
     "nv_inference_compute_infer_summary_us", "Cumulative compute inference duration in microseconds" + _NOT_CACHED,
     "compute_infer"),
    ("nv_inference_compute_output_duration_us",
     "Cumulative inference compute output duration in microseconds" + _NOT_CACHED,
     "nv_inference_compute_output_summary_us",
     "Cumulative inference compute output duration in microseconds" + _NOT_CACHED, "compute_output"),
)


class SystemUsage:
    """nv_cpu_utilization (over the time since the previous scrape) and host memory, from /proc."""

    def __init__(self) -> None:
        self._last = self._cpu_times()

    @staticmethod
    def _cpu_times() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return idle, sum(fields)

    def utilization(self) -> float:
        now = self._cpu_times()
        last, self._last = self._last, now
        if now is None or last is None or now[1] == last[1]:
            return 0.0
        return 1.0 - (now[0] - last[0]) / (now[1] - last[1])

    @staticmethod
    def memory() -> tuple[int, int]:
        info: dict[str, int] = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            return 0, 0
        total = info.get("MemTotal", 0)
        return total, total - info.get("MemAvailable", total)


class MetricsRenderer:
    def __init__(self, models: Callable[[], list[LoadedModel]], config: MetricsConfig,
                 traffic: Callable[[str], dict[int, float]] | None = None, cpu_metrics: bool = True,
                 cache: ResponseCache | None = None) -> None:
        self._models = models
        self._cache = cache
        self._cpu_metrics = cpu_metrics
        self._traffic = traffic
        self._config = config
        self._system = SystemUsage()

    @staticmethod
    def _cache_metrics(models: list[LoadedModel], cache: ResponseCache | None) -> str:
        """Triton's response cache families: per model (hits, misses and their durations) for the
        models whose config enables the cache (even with no cache configured, as Triton 2.51 does:
        zeros), and the cache's own fill when there is a cache."""
        parts = []
        models = [m for m in models if m.spec.response_cache]
        for name, help_text, stage, get in (
            ("nv_cache_num_hits_per_model", "Number of cache hits per model", "cache_hit", lambda d: d.count),
            ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
             "cache_hit", lambda d: d.ns // 1000),
            ("nv_cache_num_misses_per_model", "Number of cache misses per model", "cache_miss", lambda d: d.count),
            ("nv_cache_miss_duration_per_model",
             "Total cache miss (insert+lookup) duration per model, in microseconds", "cache_miss",
             lambda d: d.ns // 1000),
        ):
            if models:
                parts.append(family(name, "counter", help_text,
                                    [f"{name}{{{_labels(m)}}} {get(getattr(m.stats, stage))}\n" for m in models]))
        if cache is None:
            return "".join(parts)
        for name, help_text, value in (
            ("nv_cache_num_entries", "Number of responses stored in response cache", len(cache)),
            ("nv_cache_num_lookups", "Number of cache lookups in response cache", cache.hits + cache.misses),
            ("nv_cache_num_hits", "Number of cache hits in response cache", cache.hits),
            ("nv_cache_num_misses", "Number of cache misses in response cache", cache.misses),
            ("nv_cache_num_evictions", "Number of cache evictions in response cache", cache.evictions),
            ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds",
             int(cache.lookup_us)),
            ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds", int(cache.insertion_us)),
            ("nv_cache_util", "Cache utilization [0.0 - 1.0]", cache.used / cache.capacity if cache.capacity else 0.0),
        ):
            text = str(value) if isinstance(value, int) else f"{value:g}"
            parts.append(family(name, "gauge", help_text, [f"{name} {text}\n"]))
        return "".join(parts)

    def render(self) -> bytes:
        models = sorted(self._models(), key=lambda m: (m.spec.name, m.version))
        parts = []
        for name, help_text, get in _COUNTERS[:1]:
            parts.append(family(name, "counter", help_text, [f"{name}{{{_labels(m)}}} {get(m)}\n" for m in models]))
        rows = [f"nv_inference_request_failure{{{_labels(m, _reason(r))}}} "
                f"{m.stats.failures[r]}\n" for m in models for r in FAILURE_REASONS]
        parts.append(family("nv_inference_request_failure", "counter",
                            "Number of failed inference requests, all batch sizes", rows))
        for name, help_text, get in _COUNTERS[1:]:
            parts.append(family(name, "counter", help_text, [f"{name}{{{_labels(m)}}} {get(m)}\n" for m in models]))
        if self._config.counter_latencies:
            for name, help_text, _, _, stage in _STAGE_METRICS:
                rows = [f"{name}{{{_labels(m)}}} {getattr(m.stats, stage).ns // 1000}\n" for m in models]
                parts.append(family(name, "counter", help_text, rows))
        parts.append(self._cache_metrics(models, self._cache))
        parts.append(family(
            "nv_inference_pending_request_count", "gauge",
            "Instantaneous number of pending requests awaiting execution per-model.",
            [f"nv_inference_pending_request_count{{{_labels(m)}}} {m.scheduler.pending_count()}\n" for m in models]))
        if self._config.histogram_latencies:
            parts.append(self._histogram(models))
        parts.append(family("nv_model_load_duration_secs", "gauge", "Model load time in seconds",
                            [f"nv_model_load_duration_secs{{{_labels(m)}}} {m.load_duration_s:.6f}\n"
                              for m in models]))
        if self._traffic is not None:
            split = {key: self._traffic(key) for key in {m.key for m in models}}
            parts.append(family(
                "pier_model_traffic_percent", "gauge",
                "Percent of unversioned requests routed to each version (rollout weights, else newest READY)",
                [f"pier_model_traffic_percent{{{_labels(m)}}} {split[m.key].get(m.version, 0.0):g}\n"
                 for m in models]))
        for m in models:  # backend families (e.g. the LLM engine's vllm:* metrics)
            for instance in m.instances:
                parts.append(instance.prometheus(m.spec.name, m.version_str))
        # Pier keeps no pinned (page-locked) host pool: both gauges are 0, present for dashboards.
        parts.append(family("nv_pinned_memory_pool_total_bytes", "gauge",
                            "Pinned memory pool total memory size, in bytes",
                            ["nv_pinned_memory_pool_total_bytes 0\n"]))
        parts.append(family("nv_pinned_memory_pool_used_bytes", "gauge",
                            "Pinned memory pool used memory size, in bytes",
                            ["nv_pinned_memory_pool_used_bytes 0\n"]))
        if self._config.summary_latencies:
            parts.append(self._summaries(models))
        if self._cpu_metrics:
            parts.append(self._cpu())
        return "".join(parts).encode() + prometheus_client.generate_latest(prometheus_client.REGISTRY)

    def _summaries(self, models: list[LoadedModel]) -> str:
        """Triton's *_summary_us families: cumulative _count/_sum, and quantiles over the requests
        of the last SUMMARY_WINDOW_S seconds (NaN when there were none)."""
        horizon = time.monotonic() - SUMMARY_WINDOW_S
        windows = {id(m): [r for r in m.stats.recent or () if r[0] >= horizon] for m in models}

        def rows(name: str, m: LoadedModel, total: Duration, values: list[float]) -> list[str]:
            values.sort()
            out = [f"{name}_count{{{_labels(m)}}} {total.count}\n", f"{name}_sum{{{_labels(m)}}} {total.ns // 1000}\n"]
            for q, _ in self._config.summary_quantiles:
                v = values[min(len(values) - 1, int(q * len(values)))] if values else "NaN"
                out.append(f'{name}{{{_labels(m)},quantile="{q:g}"}} {v}\n')
            return out

        out = []
        for column, (_, _, name, help_text, stage) in enumerate(_STAGE_METRICS, start=1):
            out.append(family(name, "summary", help_text, [
                row for m in models
                for row in rows(name, m, getattr(m.stats, stage), [r[column] // 1000 for r in windows[id(m)]])]))
        cached = [m for m in models if m.spec.response_cache]
        for name, kind, recent in (("nv_cache_hit_summary_per_model", "hit", "recent_hits"),
                                   ("nv_cache_miss_summary_per_model", "miss", "recent_misses")):
            if not cached:
                continue
            text = f"Summary of cache {kind} counts/durations per model, in microseconds."  # Triton's words
            out.append(family(name, "summary", text, [
                row for m in cached
                for row in rows(name, m, getattr(m.stats, f"cache_{kind}"),
                                [ns // 1000 for t, ns in getattr(m.stats, recent) or () if t >= horizon])]))
        return "".join(out)

    def _cpu(self) -> str:
        total, used = self._system.memory()
        parts = []
        parts.append(family("nv_cpu_utilization", "gauge", "CPU utilization rate [0.0 - 1.0]",
                            [f"nv_cpu_utilization {self._system.utilization()}\n"]))
        parts.append(family("nv_cpu_memory_total_bytes", "gauge", "CPU total memory (RAM), in bytes",
                            [f"nv_cpu_memory_total_bytes {total}\n"]))
        parts.append(family("nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM), in bytes",
                            [f"nv_cpu_memory_used_bytes {used}\n"]))
        return "".join(parts)

    @staticmethod
    def _histogram(models: list[LoadedModel]) -> str:
        name = "nv_inference_first_response_histogram_ms"
        rows: list[str] = []
        for m in models:
            if not m.spec.decoupled:  # as Triton (2.52+): the histogram is the decoupled models'
                continue
            s = m.stats
            rows += histogram(name, _labels(m), HISTOGRAM_BUCKETS_MS, s.first_response_buckets, s.first_response_ms,
                              s.first_responses, bound_text=lambda b: f"{b:g}", sum_text=str)
        return family(name, "histogram", "Duration from request to first response in milliseconds", rows)
