"""The status page's recent past: every INTERVAL_S, per loaded model version, the requests that
finished since the last sample (throughput), their p50/p99 latency, and for LLM models the
engine's tokens/s, prefix-cache hit rate and time to first token, kept for WINDOW_S.

It reads what the server already counts: the statistics' cumulative counters and their window of
recent requests (`ModelStatistics.recent`), and a backend's Prometheus families (the LLM's
vllm:* ones, parsed with prometheus_client's parser), so a request pays nothing for the page."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pier.lifecycle.loaded_model import LoadedModel

log = logging.getLogger("pier.status")

INTERVAL_S = 2.0
WINDOW_S = 300.0
SERIES = ("requests_per_s", "p50_ms", "p99_ms", "tokens_per_s", "ttft_p50_ms", "prefix_hit_rate")
TTFT, E2E = "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"
HISTOGRAMS = (TTFT, E2E)


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile of `values` (nearest rank), None when there are none."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def bucket_quantile(bounds: list[float], counts: list[float], q: float) -> float | None:
    """The q-quantile of a histogram (`counts` per bucket, not cumulative; the last one above the
    largest bound), interpolated in its bucket as Prometheus' histogram_quantile does."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen, low = q * total, 0.0, 0.0
    for bound, n in zip([*bounds, math.inf], counts, strict=True):
        if n and seen + n >= rank:
            if math.isinf(bound):
                return low
            return low + (bound - low) * (rank - seen) / n
        seen += n
        low = bound
    return low


@dataclass
class LlmCounters:
    """The cumulative vllm:* values one sample reads (an LLM model's Prometheus text)."""

    gauges: dict[str, float] = field(default_factory=dict)
    generation_tokens: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    # time to first token and end-to-end latency: (bounds, count per bucket, not cumulative)
    histograms: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)

    def zero(self) -> LlmCounters:
        """The same families, every count 0: what a load had served before its first request."""
        return LlmCounters(histograms={k: (b, [0.0] * len(c)) for k, (b, c) in self.histograms.items()})

    def quantile(self, older: LlmCounters, name: str, q: float) -> float | None:
        """The q-quantile of histogram `name` over what was observed since `older`, in ms."""
        new, old = self.histograms.get(name), older.histograms.get(name)
        if new is None or old is None or len(new[1]) != len(old[1]):
            return None
        value = bucket_quantile(new[0], [a - b for a, b in zip(new[1], old[1], strict=True)], q)
        return None if value is None else value * 1000

    @classmethod
    def parse(cls, text: str) -> LlmCounters | None:
        """None when the text has no vllm:* families (not an LLM model)."""
        out, found = cls(), False
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("vllm:"):
                continue
            found = True
            if fam.name in HISTOGRAMS:
                cumulative = sorted((float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket"))
                counts = [v - prev for (_, v), prev in zip(cumulative, [0.0] + [v for _, v in cumulative])]
                out.histograms[fam.name] = ([b for b, _ in cumulative if not math.isinf(b)], counts)
                continue
            for s in fam.samples:
                if s.name == "vllm:generation_tokens_total":
                    out.generation_tokens += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    out.prefix_queries += s.value
                elif s.name == "vllm:prefix_cache_hits_total":
                    out.prefix_hits += s.value
                elif fam.type == "gauge" and s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                        "vllm:kv_cache_usage_perc"):
                    key = s.name.removeprefix("vllm:")
                    out.gauges[key] = out.gauges.get(key, 0.0) + s.value
        return out if found else None


@dataclass
class _Track:
    """One model version's samples."""

    last_t: float
    last_done: int
    last_llm: LlmCounters | None
    llm: LlmCounters | None = None  # the latest reading (the page's gauges)
    points: deque[tuple[float, dict[str, float | None]]] = field(
        default_factory=lambda: deque(maxlen=int(WINDOW_S / INTERVAL_S)))


def _done(m: LoadedModel) -> int:
    return m.stats.success.count + m.stats.fail.count


def _llm(m: LoadedModel) -> LlmCounters | None:
    """The vllm:* figures of the model's instances; None for a model without them, or whose text
    does not parse (a Python model's custom metrics are the model's own: its figures stay out)."""
    texts = [inst.prometheus(m.spec.name, m.version_str) for inst in m.instances]
    try:
        return LlmCounters.parse("".join(texts)) if any(texts) else None
    except ValueError:
        log.debug("status page: the metrics of '%s' version %s do not parse", m.spec.name, m.version_str)
        return None


class History:
    """Samples `models()` every INTERVAL_S on the server's loop (`run`); `series` reads it."""

    def __init__(self, models: Callable[[], list[LoadedModel]]) -> None:
        self._models = models
        self._tracks: dict[int, _Track] = {}  # by LoadedModel.load_id: a reload starts afresh

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        live = {m.load_id: m for m in self._models()}
        for gone in self._tracks.keys() - live.keys():
            del self._tracks[gone]
        for load_id, m in live.items():
            track = self._tracks.get(load_id)
            llm = _llm(m)
            if track is None:  # loaded since the last sample, at most INTERVAL_S ago: all it served counts
                track = self._tracks[load_id] = _Track(now - INTERVAL_S, 0, None if llm is None else llm.zero())
            span = max(now - track.last_t, 1e-9)
            done = _done(m)
            recent = [r[1] / 1e6 for r in m.stats.recent or () if track.last_t < r[0] <= now]
            point: dict[str, float | None] = {
                "requests_per_s": (done - track.last_done) / span,
                "p50_ms": quantile(recent, 0.5),
                "p99_ms": quantile(recent, 0.99),
            }
            if llm is not None and track.last_llm is not None:
                old = track.last_llm
                queries = llm.prefix_queries - old.prefix_queries
                point["tokens_per_s"] = (llm.generation_tokens - old.generation_tokens) / span
                point["prefix_hit_rate"] = (llm.prefix_hits - old.prefix_hits) / queries if queries > 0 else None
                point["ttft_p50_ms"] = llm.quantile(old, TTFT, 0.5)
                # A streamed request's latency is the engine's, to its last token (the data plane's
                # statistics end when the backend takes the request): vllm:e2e_request_latency_seconds.
                if E2E in llm.histograms:
                    point["p50_ms"], point["p99_ms"] = llm.quantile(old, E2E, 0.5), llm.quantile(old, E2E, 0.99)
            track.points.append((now, point))
            track.last_t, track.last_done, track.last_llm, track.llm = now, done, llm, llm

    def series(self, m: LoadedModel) -> tuple[dict[str, list[float | None]], LlmCounters | None]:
        """The model's points (seconds ago, and each measure, oldest first) and its latest LLM reading."""
        track = self._tracks.get(m.load_id)
        if track is None:
            return {"t": []}, None
        now = time.monotonic()
        out: dict[str, list[float | None]] = {"t": [round(t - now, 1) for t, _ in track.points]}
        for name in SERIES:
            values = [p.get(name) for _, p in track.points]
            if any(name in p for _, p in track.points):
                out[name] = [None if v is None else round(v, 3) for v in values]
        return out, track.llm

    async def run(self) -> None:
        """Sample until cancelled (the server's shutdown)."""
        while True:
            try:
                self.sample()
            except Exception:  # a backend's metrics text must not stop the page: say so, go on
                log.warning("status page: sampling failed", exc_info=True)
            await asyncio.sleep(INTERVAL_S)
