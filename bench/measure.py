"""Measurements: one perf_analyzer run per point, direct onnxruntime calls, the result record, and
the order of the measured rows within a round.

Every measurement is bounded: perf_analyzer runs under a timeout derived from its window and trial
count; loops of our own stop after a fixed time and a fixed number of calls.
"""

from __future__ import annotations

import csv
import re
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from bench.common import CACHE, Settings, log

T = TypeVar("T")


@dataclass
class Point:
    """One measured point. Throughput is per second (requests, or sequences for the embedding
    benchmark); latencies in microseconds."""

    throughput: float
    p50_us: float
    p90_us: float
    p99_us: float
    avg_us: float | None = None
    count: int | None = None
    stable: bool = True
    errors: int = 0
    client_cpu: float | None = None  # load generator CPU use, fraction of one core
    server_cpu_us: float | None = None  # the server's CPU time per answered request (bench/server_cpu.py)
    server_cpu_counted: str = ""  # what counted the requests: "statistics" (the server's) or "throughput"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def alternate(items: Sequence[T], rnd: int) -> list[T]:
    """The order in which round `rnd` (from 0) measures `items`: as given in even rounds, reversed in
    odd ones (ABBA for two), so that the machine's drift over a pair of rounds weighs on each alike."""
    return list(items) if rnd % 2 == 0 else list(items)[::-1]


def median_point(points: list[Point]) -> Point | None:
    """The round with the median throughput (its latencies with it); stability is ANDed."""
    points = [p for p in points if p is not None]
    if not points:
        return None
    ordered = sorted(points, key=lambda p: p.throughput)
    mid = ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else None
    if mid is None:  # even count: average the two middle rounds
        a, b = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
        mid = Point(throughput=(a.throughput + b.throughput) / 2, p50_us=(a.p50_us + b.p50_us) / 2,
                    p90_us=(a.p90_us + b.p90_us) / 2, p99_us=(a.p99_us + b.p99_us) / 2,
                    avg_us=None if a.avg_us is None or b.avg_us is None else (a.avg_us + b.avg_us) / 2,
                    count=(a.count or 0) + (b.count or 0), errors=a.errors + b.errors,
                    client_cpu=None if a.client_cpu is None or b.client_cpu is None
                    else (a.client_cpu + b.client_cpu) / 2,
                    server_cpu_us=None if a.server_cpu_us is None or b.server_cpu_us is None
                    else (a.server_cpu_us + b.server_cpu_us) / 2, server_cpu_counted=a.server_cpu_counted)
    else:
        mid = Point(**{**asdict(mid), "extra": {}})
    mid.stable = all(p.stable for p in points)
    mid.extra = {"rounds": [round(p.throughput, 1) for p in points]}
    return mid


# ---------------------------------------------------------------------------- perf_analyzer

class PerfAnalyzerError(RuntimeError):
    pass


_AVG = re.compile(r"Avg latency: (\d+) usec")
_COUNT = re.compile(r"Request count: (\d+)")


def perf_analyzer_point(pa: Path, settings: Settings, model: str, url: str, protocol: str, concurrency: int,
                        data_args: list[str], label: str, window_ms: int | None = None) -> Point:
    """perf_analyzer at one concurrency (batch 1, sync). If the windows do not stabilise within
    -r trials (a noisy machine), it is rerun with a 50 % threshold, then with the threshold
    effectively off (3 windows, -s 1000), and the point is marked unstable."""
    CACHE.mkdir(parents=True, exist_ok=True)
    csv_path = CACHE / f"pa_{int(time.time() * 1e6)}.csv"
    last = ""
    window_ms = window_ms or settings.window_ms
    attempts = [(settings.stability, settings.max_trials)]
    if settings.stability < 50:
        attempts.append((50, settings.max_trials))
    attempts.append((1000, 3))
    for stability, trials in attempts:
        csv_path.unlink(missing_ok=True)
        cmd = [str(pa), "-m", model, "-i", protocol, "-u", url, *data_args,
               "--concurrency-range", str(concurrency), "-p", str(window_ms),
               "-s", str(stability), "-r", str(trials), "-f", str(csv_path)]
        # windows + warm-up + connection set-up; slow requests stretch a window to finish in-flight ones
        timeout = trials * window_ms / 1000 * 2.5 + 30
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=CACHE)
        except subprocess.TimeoutExpired:
            raise PerfAnalyzerError(f"{label}: perf_analyzer timed out after {timeout:.0f} s") from None
        last = proc.stdout + proc.stderr
        rows = []
        if csv_path.exists():
            with open(csv_path, newline="") as fh:
                rows = [r for r in csv.DictReader(fh) if r.get("Concurrency") == str(concurrency)]
            csv_path.unlink(missing_ok=True)
        if proc.returncode == 0 and rows:
            r = rows[0]
            avg = _AVG.search(proc.stdout)
            count = _COUNT.search(proc.stdout)
            return Point(throughput=float(r["Inferences/Second"]), p50_us=float(r["p50 latency"]),
                         p90_us=float(r["p90 latency"]), p99_us=float(r["p99 latency"]),
                         avg_us=float(avg.group(1)) if avg else None, count=int(count.group(1)) if count else None,
                         stable=stability == settings.stability)
        if "stable" not in last:  # a real error, not instability: no point retrying
            break
        log(f"{label}: not stable within {trials} windows at -s {stability}; retrying with a looser threshold")
    tail = "\n".join(last.strip().splitlines()[-8:])
    raise PerfAnalyzerError(f"{label}: perf_analyzer failed (rc {proc.returncode}):\n{tail}")


# ---------------------------------------------------------------------------- direct calls

def timed_loop(fn, duration_s: float, warmup_s: float, max_calls: int = 1_000_000, items_per_call: int = 1) -> Point:
    """Call `fn()` back to back for `duration_s` (after `warmup_s`), at most `max_calls` times."""
    end_warm = time.perf_counter() + warmup_s
    while time.perf_counter() < end_warm:
        fn()
    lat = []
    cpu0 = time.process_time()
    start = time.perf_counter()
    deadline = start + duration_s
    now = start
    while now < deadline and len(lat) < max_calls:
        t0 = now
        fn()
        now = time.perf_counter()
        lat.append(now - t0)
    elapsed = now - start
    us = np.asarray(lat) * 1e6
    return Point(throughput=len(lat) * items_per_call / elapsed, p50_us=float(np.percentile(us, 50)),
                 p90_us=float(np.percentile(us, 90)), p99_us=float(np.percentile(us, 99)),
                 avg_us=float(us.mean()), count=len(lat),
                 client_cpu=(time.process_time() - cpu0) / elapsed)


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def fmt_ms(us: float | None) -> str:
    if us is None:
        return "—"
    ms = us / 1000
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "—"
    return f"{a / b:.2f}×"


def spread(points: list[Point]) -> str:
    vals = [p.throughput for p in points if p is not None]
    if len(vals) < 2:
        return ""
    return f"{min(vals):,.0f}–{max(vals):,.0f}"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None
