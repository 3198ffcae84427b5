"""(c) KServe-v2 HTTP with JSON tensors (no binary extension): our own bounded asyncio/aiohttp load
generator (bench/loadgen.py) at concurrency 1 and 16 against Pier and against the bare aiohttp server
(bare_http.py, which answers JSON bodies too: it echoes `data` back). identity_fp32, [1, 16] FP32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench import loadgen, report
from bench.common import ROOT, Settings, log, temp_dir
from bench.measure import alternate
from bench.servers import Servers, copy_without_queue_delay, measure, start_bare_http, start_pier

PIER, PIER_NO_DELAY, BARE = "Pier", "Pier, no queue delay", "bare aiohttp"
CONCURRENCY = [1, 16]
MODEL = "identity_fp32"


def _checker(expected: list[float]):
    def check(payload: bytes) -> None:
        body = json.loads(payload)
        out = body["outputs"][0]
        if out["name"] != "OUTPUT0" or out["datatype"] != "FP32" or out["data"] != expected:
            raise RuntimeError(f"unexpected JSON answer: {payload[:300]!r}")

    return check


def run(settings: Settings) -> Path:
    started = report.started_info()
    group = report.Group("HTTP JSON tensors, identity_fp32 [1, 16] FP32, own load generator", "concurrency",
                         "req/s", [PIER, PIER_NO_DELAY, BARE], CONCURRENCY, refs=[BARE])
    notes: list[str] = []
    body = loadgen.identity_json_body(16)
    check = _checker(json.loads(body)["inputs"][0]["data"])
    cpu: list[str] = []
    with Servers() as servers, temp_dir("json-") as tmp:
        shutil.copytree(ROOT / "model_repository" / MODEL, tmp / "pier" / MODEL)
        copy_without_queue_delay(ROOT / "model_repository" / MODEL, tmp / "pier_no_delay" / MODEL)
        up = {PIER: servers.add(PIER, lambda: start_pier("pier_json", tmp / "pier"), required=True),
              PIER_NO_DELAY: servers.add(PIER_NO_DELAY,
                                         lambda: start_pier("pier_json_no_delay", tmp / "pier_no_delay")),
              BARE: servers.add(BARE, start_bare_http)}
        notes += servers.left_out_notes()
        names = [n for n in (PIER, PIER_NO_DELAY, BARE) if up[n] is not None]
        for rnd in range(settings.rounds):
            for c in CONCURRENCY:
                for name in alternate(names, rnd):
                    srv = up[name]
                    pt = measure(srv, lambda s=srv, c=c: loadgen.run(
                        f"http://{s.http}/v2/models/{MODEL}/infer", body, c, settings.loadgen_s, settings.warmup_s,
                        max_requests=200_000, check=check), f"round {rnd + 1} c={c} {name}", notes)
                    if pt is None:
                        continue
                    log(f"round {rnd + 1} c={c} {name}: {pt.throughput:,.0f} req/s p50 {pt.p50_us / 1000:.2f} ms "
                        f"p99 {pt.p99_us / 1000:.2f} ms errors {pt.errors} client CPU {pt.client_cpu:.0%}")
                    cpu.append(f"c={c} {name} {pt.client_cpu:.0%}")
                    group.add(name, c, pt)
    targets = [group.target(f"c={c}: Pier ≥ 0.70× bare aiohttp", PIER, c, BARE, 0.7) for c in CONCURRENCY]
    group.notes += [
        "Closed loop: each of `concurrency` workers sends its next request when the previous answer is read; "
        f"{settings.loadgen_s:g} s measured after {settings.warmup_s:g} s warm-up, at most 200,000 requests; "
        "every answer must be 200 (others count as errors); the first answer's JSON is checked "
        "(OUTPUT0 data == INPUT0 data).",
        "The load generator is Python (aiohttp + uvloop, one process) on the same 2 cores: at high "
        "concurrency it competes with the server for CPU and caps both servers alike, which pulls ratios "
        "towards 1. Its CPU use (fraction of one core) per point: " + ", ".join(cpu) + ".",
        "Comparable: both servers parse the JSON request and write a JSON answer with the data; the bare "
        "server does no validation, no datatype conversion (it echoes the `data` list as parsed) and no "
        "statistics.",
        "`Pier, no queue delay` is the same Pier with `max_queue_delay_microseconds: 0`, for reading only (the "
        "target compares the example's config): the bare server does not batch, so the gap between the two "
        "Pier rows is the configured 100 µs batching wait.",
    ]
    intro = ["KServe-v2 JSON tensor bodies (`Content-Type: application/json`, no "
             "`Inference-Header-Content-Length`), measured with `bench/loadgen.py`, not perf_analyzer "
             "(which always uses the binary extension over HTTP)."]
    return report.write("http_json", "HTTP JSON: Pier vs bare aiohttp server", settings, [group], targets,
                        intro, notes, started)
