"""A server's CPU time per answered request, the figure that carries to a larger machine (on these
2 shared cores throughput is capped by whichever process holds a core, not by the work per
request): the CPU time of every process of the server (the server's own and its children: Python
stubs, frontend processes, Triton's backend stubs), read from /proc before and after a
measurement, divided by the requests the server's own statistics say it answered in between."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import requests

from bench.measure import Point
from bench.servers import Server

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
    except OSError:
        return None


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of `root` and every live process below it (/proc)."""
    children: dict[int, list[int]] = {}
    fields: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (f := _stat(int(entry))) is not None:
            fields[int(entry)] = f
            children.setdefault(int(f[1]), []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in fields:
            total += int(fields[pid][11]) + int(fields[pid][12])  # utime, stime (after comm: fields 14, 15)
        todo += children.get(pid, [])
    return total / _TICK


def model_stats(server: Server, model: str) -> list[dict[str, Any]]:
    """`model`'s entries in the server's KServe-v2 statistics ([] when it answers none)."""
    if server.http is None:
        return []
    try:
        stats = requests.get(f"http://{server.http}/v2/models/{model}/stats", timeout=5).json()["model_stats"]
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return []
    return stats if isinstance(stats, list) else []


def answered(server: Server, model: str) -> int | None:
    """The successful requests `model` counts in the server's statistics (KServe-v2 stats, which
    Pier and Triton keep); None when the server keeps none (the bare servers answer fixed stats)."""
    try:
        counts = [m["inference_stats"]["success"]["count"] for m in model_stats(server, model)]
    except (KeyError, TypeError):
        return None
    return sum(counts) if any(counts) else None


def metered(server: Server, model: str, fn: Callable[[], Point]) -> Point:
    """`fn()`'s point with `server_cpu_us` set: the server's CPU time over the whole call (warm-up
    and every window) per request answered in it. The count is the server's own; for a server
    without statistics it is the point's throughput times the call's duration (marked in
    `server_cpu_counted`)."""
    pid = server.proc.pid if server.proc is not None else server.pid
    if pid is None or not os.path.isdir("/proc"):
        return fn()
    n0, cpu0, t0 = answered(server, model), tree_cpu_s(pid), time.monotonic()
    point = fn()
    cpu1, t1, n1 = tree_cpu_s(pid), time.monotonic(), answered(server, model)
    if n0 is not None and n1 is not None and n1 > n0:
        count, point.server_cpu_counted = n1 - n0, "statistics"
    else:
        count, point.server_cpu_counted = round(point.throughput * (t1 - t0)), "throughput"
    if count > 0:
        point.server_cpu_us = (cpu1 - cpu0) * 1e6 / count
    return point
