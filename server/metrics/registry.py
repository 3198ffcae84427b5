"""Every Prometheus metric Pier exports, with Triton's names and labels, rendered at scrape time
from the same per-version counters the statistics extension reports.

The text is written here rather than through prometheus_client's counters because Triton's
counter names carry no `_total` suffix and existing dashboards query them as they are;
prometheus_client still supplies the process_* / python_* families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import prometheus_client

from server.lifecycle.loaded_model import LoadedModel
from server.statistics import FAILURE_REASONS, HISTOGRAM_BUCKETS_MS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class MetricsConfig:
    """`--metrics-config` keys, as tritonserver spells them."""

    counter_latencies: bool = True
    histogram_latencies: bool = False

    @classmethod
    def parse(cls, items: Iterable[str]) -> MetricsConfig:
        values: dict[str, bool] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or key not in ("counter_latencies", "histogram_latencies"):
                raise ValueError(f"unsupported --metrics-config '{item}' (known: counter_latencies, "
                                 "histogram_latencies, each =true or =false)")
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--metrics-config {key} must be true or false, got '{value}'")
            values[key] = value.lower() in ("true", "1")
        return cls(**values)


def _labels(model: LoadedModel) -> str:
    return f'model="{model.spec.name}",version="{model.version_str}"'


def _family(name: str, kind: str, help_text: str, rows: list[str]) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" + "".join(rows)


_COUNTERS: tuple[tuple[str, str, Callable[[LoadedModel], int]], ...] = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     lambda m: m.stats.success.count),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     lambda m: m.stats.inference_count),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     lambda m: m.stats.execution_count),
)
_DURATIONS: tuple[tuple[str, str, str], ...] = (
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds", "success"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds", "queue"),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds",
     "compute_input"),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds",
     "compute_infer"),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds",
     "compute_output"),
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
                 traffic: Callable[[str], dict[int, float]] | None = None) -> None:
        self._models = models
        self._traffic = traffic
        self._config = config
        self._system = SystemUsage()

    def render(self) -> bytes:
        models = sorted(self._models(), key=lambda m: (m.spec.name, m.version))
        parts = []
        for name, help_text, get in _COUNTERS[:1]:
            parts.append(_family(name, "counter", help_text, [f"{name}{{{_labels(m)}}} {get(m)}\n" for m in models]))
        rows = [f'nv_inference_request_failure{{model="{m.spec.name}",reason="{r}",version="{m.version_str}"}} '
                f"{m.stats.failures[r]}\n" for m in models for r in FAILURE_REASONS]
        parts.append(_family("nv_inference_request_failure", "counter",
                             "Number of failed inference requests, all batch sizes", rows))
        for name, help_text, get in _COUNTERS[1:]:
            parts.append(_family(name, "counter", help_text, [f"{name}{{{_labels(m)}}} {get(m)}\n" for m in models]))
        if self._config.counter_latencies:
            for name, help_text, stage in _DURATIONS:
                rows = [f"{name}{{{_labels(m)}}} {getattr(m.stats, stage).ns // 1000}\n" for m in models]
                parts.append(_family(name, "counter", help_text, rows))
        parts.append(_family(
            "nv_inference_pending_request_count", "gauge",
            "Instantaneous number of pending requests awaiting execution per-model.",
            [f"nv_inference_pending_request_count{{{_labels(m)}}} {m.scheduler.pending_count()}\n" for m in models]))
        if self._config.histogram_latencies:
            parts.append(self._histogram(models))
        parts.append(_family("nv_model_load_duration_secs", "gauge", "Model load time in seconds",
                             [f"nv_model_load_duration_secs{{{_labels(m)}}} {m.load_duration_s:.6f}\n"
                              for m in models]))
        if self._traffic is not None:
            split = {name: self._traffic(name) for name in {m.spec.name for m in models}}
            parts.append(_family(
                "pier_model_traffic_percent", "gauge",
                "Percent of unversioned requests routed to each version (rollout weights, else newest READY)",
                [f"pier_model_traffic_percent{{{_labels(m)}}} {split[m.spec.name].get(m.version, 0.0):g}\n"
                 for m in models]))
        for m in models:  # backend families (e.g. the LLM engine's vllm:* metrics)
            for instance in m.instances:
                parts.append(instance.prometheus(m.spec.name, m.version_str))
        total, used = self._system.memory()
        parts.append(_family("nv_cpu_utilization", "gauge", "CPU utilization rate [0.0 - 1.0]",
                             [f"nv_cpu_utilization {self._system.utilization()}\n"]))
        parts.append(_family("nv_cpu_memory_total_bytes", "gauge", "CPU total memory (RAM), in bytes",
                             [f"nv_cpu_memory_total_bytes {total}\n"]))
        parts.append(_family("nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM), in bytes",
                             [f"nv_cpu_memory_used_bytes {used}\n"]))
        return "".join(parts).encode() + prometheus_client.generate_latest(prometheus_client.REGISTRY)

    @staticmethod
    def _histogram(models: list[LoadedModel]) -> str:
        name = "nv_inference_first_response_histogram_ms"
        rows = []
        for m in models:
            cumulative = 0
            for bound, count in zip(HISTOGRAM_BUCKETS_MS, m.stats.latency_buckets):
                cumulative += count
                rows.append(f'{name}_bucket{{{_labels(m)},le="{bound:g}"}} {cumulative}\n')
            cumulative += m.stats.latency_buckets[-1]
            rows.append(f'{name}_bucket{{{_labels(m)},le="+Inf"}} {cumulative}\n')
            rows.append(f"{name}_sum{{{_labels(m)}}} {m.stats.success.ns / 1e6}\n")
            rows.append(f"{name}_count{{{_labels(m)}}} {m.stats.success.count}\n")
        return _family(name, "histogram", "Duration from request to first response in milliseconds", rows)
