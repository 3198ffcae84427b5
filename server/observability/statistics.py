"""Per-version inference statistics with Triton's fields (the statistics extension).

All durations are cumulative nanoseconds. `inference_count` counts batch elements,
`execution_count` model executions. Only the event loop thread writes these counters.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


# Buckets of nv_inference_first_response_histogram_ms (Triton's defaults), milliseconds.
HISTOGRAM_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)
_BUCKET_NS = tuple(int(b * 1_000_000) for b in HISTOGRAM_BUCKETS_MS)
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
RECENT_REQUESTS = 4096
_STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
           "cache_hit", "cache_miss")


@dataclass(slots=True)
class ModelStatistics:
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStats] = field(default_factory=dict)
    # failed requests by Triton's metric reason: REJECTED, CANCELED, BACKEND, OTHER
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    # decoupled models: time to each request's first response, per histogram bucket (last slot:
    # above the largest bound), with the sum in whole milliseconds and the count
    first_response_buckets: list[int] = field(default_factory=lambda: [0] * (len(HISTOGRAM_BUCKETS_MS) + 1))
    first_response_ms: int = 0
    first_responses: int = 0
    # recent successful requests (monotonic s, total, queue, input, infer, output ns): the window
    # the summary metrics' quantiles are computed over; None (nothing kept) unless they are on
    recent: deque[tuple[float, int, int, int, int, int]] | None = None
    # the same for response-cache hits and misses (monotonic s, duration ns)
    recent_hits: deque[tuple[float, int]] | None = None
    recent_misses: deque[tuple[float, int]] | None = None

    @classmethod
    def create(cls, keep_recent: bool) -> ModelStatistics:
        """Statistics that keep a bounded window of recent requests when `keep_recent` (summaries)."""
        if not keep_recent:
            return cls()
        return cls(recent=deque(maxlen=RECENT_REQUESTS), recent_hits=deque(maxlen=RECENT_REQUESTS),
                   recent_misses=deque(maxlen=RECENT_REQUESTS))

    def record_execution(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int,
                         succeeded: int | None = None) -> None:
        """One model execution over `batch_size` elements, `succeeded` of them successfully (all,
        when None). As Triton 2.51 counts them (probed): every execution adds to execution_count,
        only successful inferences to inference_count."""
        self.execution_count += 1
        self.inference_count += batch_size if succeeded is None else succeeded
        b = self.batches.get(batch_size)
        if b is None:
            b = self.batches[batch_size] = BatchStats()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)

    def record_cache_hit(self, lookup_ns: int) -> None:
        """A request answered from the response cache in `lookup_ns`: a success (and a queue
        entry, as Triton counts it) that ran nothing."""
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.success.add(lookup_ns)
        self.queue.add(0)
        self.cache_hit.add(lookup_ns)
        if self.recent_hits is not None:
            self.recent_hits.append((time.monotonic(), lookup_ns))

    def record_cache_miss(self, ns: int) -> None:
        """A cache miss: the lookup and the insertion of the response computed, `ns` in all."""
        self.cache_miss.add(ns)
        if self.recent_misses is not None:
            self.recent_misses.append((time.monotonic(), ns))

    def record_first_response(self, ns: int) -> None:
        """A decoupled model's first response to a request, `ns` after the request arrived."""
        self.first_response_buckets[bisect.bisect_left(_BUCKET_NS, ns)] += 1
        self.first_response_ms += ns // 1_000_000
        self.first_responses += 1

    def record_request(self, ok: bool, total_ns: int, queue_ns: int = 0, input_ns: int = 0,
                       infer_ns: int = 0, output_ns: int = 0, reason: str | None = None) -> None:
        """One finished request (per-request stage durations count only on success)."""
        self.last_inference_ms = time.time_ns() // 1_000_000
        if not ok:
            self.fail.add(total_ns)
            self.failures[reason if reason in self.failures else "OTHER"] += 1
            return
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.compute_input.add(input_ns)
        self.compute_infer.add(infer_ns)
        self.compute_output.add(output_ns)
        if self.recent is not None:
            self.recent.append((time.monotonic(), total_ns, queue_ns, input_ns, infer_ns, output_ns))

    def as_dict(self, name: str, version: str) -> dict[str, Any]:
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {s: getattr(self, s).as_dict() for s in _STAGES},
            "response_stats": {},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": b.compute_input.as_dict(),
                    "compute_infer": b.compute_infer.as_dict(),
                    "compute_output": b.compute_output.as_dict(),
                }
                for size, b in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }
