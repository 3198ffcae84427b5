"""OpenTelemetry trace mode under load: does a collector that is down slow requests? Side by side in
one run, every request traced (rate=1, the worst case):

- `tracing off`: Pier as it ships (the anchor);
- `OpenTelemetry, collector up`: `--trace-config mode=opentelemetry`, spans exported over OTLP/HTTP
  to a receiver in its own process (tests/otlp_receiver.py: decodes and counts them);
- `OpenTelemetry, collector down`: the same, its URL a port where nothing listens.

perf_analyzer on identity_fp32 (batch 1, INPUT0 [16] FP32) over HTTP and gRPC at concurrency 1 and 8,
interleaved rounds (the order rotates per round); ratios are the median of per-round ratios. After
the run each traced server's /metrics says what became of its spans (exported, dropped because the
queue was full, lost because the export failed).

    .venv/bin/python -m bench.otel            # 3 rounds
    .venv/bin/python -m bench.otel --quick    # 1 round, short windows

Writes bench/results/otel[-quick].{md,json,png}.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import requests

from bench import report
from bench.common import ROOT, Settings, free_port, log, temp_dir
from bench.measure import perf_analyzer_point
from bench.servers import Server, Servers, measure, round_order, start_pier
from bench.tools import perf_analyzer_required

OFF, UP, DOWN = "tracing off", "OpenTelemetry, collector up", "OpenTelemetry, collector down"
NAMES = [OFF, UP, DOWN]
CONCURRENCY = [1, 8]
MODEL = "identity_fp32"
TRACED = ["--trace-config=mode=opentelemetry", "--trace-config=rate=1", "--trace-config=level=TIMESTAMPS"]


def _counts(server: Server) -> dict[str, int]:
    text = requests.get(f"http://{server.http}/metrics", timeout=10).text
    out = {"exported": int(re.search(r"^pier_trace_spans_exported_total (\d+)", text, re.M).group(1))}  # type: ignore[union-attr]
    out.update({k: int(v) for k, v in re.findall(r'pier_trace_spans_dropped_total\{reason="(\w+)"\} (\d+)', text)})
    return out


def run(settings: Settings) -> Path:
    pa = perf_analyzer_required()
    started = report.started_info()
    notes: list[str] = []
    groups = [report.Group(f"identity_fp32 over {proto}, batch 1, INPUT0 [16] FP32, every request traced",
                           "concurrency", "infer/s", NAMES, CONCURRENCY, subject="OpenTelemetry", refs=[OFF, UP])
              for proto in ("HTTP", "gRPC")]
    collector = subprocess.Popen([sys.executable, "-m", "tests.otlp_receiver"], cwd=ROOT, stdout=subprocess.PIPE,
                                 text=True)
    counts: dict[str, dict[str, int]] = {}
    try:
        url = collector.stdout.readline().strip()  # type: ignore[union-attr]
        down = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
        with Servers() as servers, temp_dir("otel-") as tmp:
            repo = tmp / "repo"
            shutil.copytree(ROOT / "model_repository" / MODEL, repo / MODEL)
            up = {OFF: servers.add(OFF, lambda: start_pier("pier_tracing_off", repo), required=True),
                  UP: servers.add(UP, lambda: start_pier("pier_otel_up", repo, *TRACED,
                                                         f"--trace-config=opentelemetry,url={url}"), required=True),
                  DOWN: servers.add(DOWN, lambda: start_pier("pier_otel_down", repo, *TRACED,
                                                             f"--trace-config=opentelemetry,url={down}"),
                                    required=True)}
            notes += servers.left_out_notes()
            for rnd in range(settings.rounds):
                for group, proto in zip(groups, ("http", "grpc"), strict=True):
                    for c in CONCURRENCY:
                        for name in round_order(NAMES, up, rnd):
                            srv = up[name]
                            assert srv is not None
                            label = f"round {rnd + 1} {proto} c={c} {name}"
                            target = srv.http if proto == "http" else srv.grpc
                            pt = measure(srv, lambda u=target, p=proto, c=c, lb=label: perf_analyzer_point(
                                pa, settings, MODEL, u, p, c, ["--shape", "INPUT0:16"], lb), label, notes)
                            if pt is not None:
                                log(f"{label}: {pt.throughput:,.0f} infer/s p50 {pt.p50_us / 1000:.2f} ms")
                                group.add(name, c, pt)
            for name in (UP, DOWN):
                srv = up[name]
                if srv is not None:
                    counts[name] = _counts(srv)
    finally:
        collector.terminate()
        received = (collector.communicate(timeout=30)[0] or "").strip().splitlines()
    notes.append(f"spans per traced server (/metrics at the end): {counts}; the collector process: "
                 f"{received[-1] if received else '?'}")
    targets = [g.target(f"{proto} c={c}: collector down ≥ 0.95× collector up", DOWN, c, UP, 0.95)
               for g, proto in zip(groups, ("HTTP", "gRPC"), strict=True) for c in CONCURRENCY]
    intro = [
        f"perf_analyzer 2.51 (sync, batch 1) on the same {os.cpu_count()}-core machine as the servers and the "
        "collector: the cores are shared by the three servers (one measured at a time), the load generator, "
        "the model and the collector process. Every request is traced (`rate=1`), so each one makes three "
        "spans (InferRequest, identity_fp32, compute). Spans leave through the SDK's batch span processor "
        "(default bsp settings: queue 2048, batches of 512, every 5 s): ending a span only queues it, so a "
        "collector that refuses connections costs the request nothing; the SDK's exporter thread retries "
        "each batch (with backoff, up to 10 s), the queue fills, and further spans are dropped and counted.",
    ]
    return report.write("otel", "OpenTelemetry trace mode: collector up vs down vs tracing off", settings, groups,
                        targets, intro, notes, started, extra_raw={"span_counts": counts})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    print(run(Settings.make(args.quick, args.rounds)))


if __name__ == "__main__":
    sys.exit(main())
