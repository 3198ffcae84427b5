"""Issue 30's floor: what the protocol layers under the bare servers cost, measured beside Pier.

identity_fp32, batch 1, INPUT0 [16] FP32, perf_analyzer (sync) over HTTP (binary tensors) and gRPC at
concurrency 1 and 8, with the server's CPU time per request:
- HTTP: Pier; python-limit's bare aiohttp server; the same echo on a raw asyncio protocol with
  httptools under uvloop (bench/floor/raw_http.py: no aiohttp web layer), the fastest a Python HTTP
  layer answers and what an infer route below aiohttp could reach.
- gRPC: Pier; python-limit's bare grpc.aio server (generated servicer); the same with ModelInfer on a
  generic handler whose answer is bytes written by hand (bench/floor/generic_grpc.py), the
  alternative grpc.aio offers to building and serialising a response message.
Rounds are interleaved (the order rotates). The report's notes split Pier's CPU per request into
its protocol layer's (the echo server of the layer Pier answers on: raw HTTP, since Pier serves a
plain infer below aiohttp; grpc.aio's generated servicer) and its own work, and give the budget
issue 30's targets leave that work.

    python -m bench.protocol_floor [--quick] [--rounds N]

Needs perf_analyzer and the python-limit servers ($PIER_REFERENCE_TOOLS); the raw HTTP row needs
httptools (pip install httptools; not a dependency of Pier) and is left out without it."""

from __future__ import annotations

import importlib.util
import shutil
import statistics
import sys
from pathlib import Path

from bench import report
from bench.common import ROOT, Settings, free_port, temp_dir
from bench.identity import MODEL, identity_rounds
from bench.servers import (
    Server,
    Servers,
    _popen,
    ready_or_stopped,
    start_bare_grpc,
    start_bare_http,
    start_pier,
    wait_grpc_ready,
    wait_http_ready,
)
from bench.tools import ToolMissing, perf_analyzer_required, python_limit_dir, reference_missing

PIER, BARE_HTTP, RAW_HTTP = "Pier", "bare aiohttp", "raw httptools (no aiohttp web layer)"
BARE_GRPC, GENERIC_GRPC = "bare grpc.aio", "grpc.aio generic handler, bytes answer"
CONCURRENCY = [1, 8]
FLOOR = Path(__file__).parent / "floor"


def start_raw_http(timeout: float = 30) -> Server:
    if importlib.util.find_spec("httptools") is None:
        raise ToolMissing(f"{RAW_HTTP} left out: httptools is not installed (pip install httptools)")
    port = free_port()
    proc, log_path = _popen([sys.executable, str(FLOOR / "raw_http.py"), str(port)], "raw_http")
    server = Server(RAW_HTTP, http=f"127.0.0.1:{port}", proc=proc, log_path=log_path)
    return ready_or_stopped(server, lambda: wait_http_ready(server, timeout))


def start_generic_grpc(timeout: float = 30) -> Server:
    limit = python_limit_dir()
    if limit is None:
        raise ToolMissing(reference_missing("python-limit", GENERIC_GRPC))
    port = free_port()
    proc, log_path = _popen([sys.executable, str(FLOOR / "generic_grpc.py"), str(port), str(limit)], "generic_grpc")
    server = Server(GENERIC_GRPC, grpc=f"127.0.0.1:{port}", proc=proc, log_path=log_path)
    return ready_or_stopped(server, lambda: wait_grpc_ready(server, timeout))


def _cpu(group: report.Group, server: str, c: int) -> float | None:
    values = [p.server_cpu_us for p in group.data.get((server, c), []) if p.server_cpu_us]
    return statistics.median(values) if values else None


def budget_note(title: str, c: int, cpu: dict[str, float], bare: str, layer: str, target: float) -> str:
    """Pier's CPU per request split into its protocol layer's (measured as the `layer` echo server,
    the layer Pier answers on) and its own work, and what the target leaves that work (`cpu`:
    server -> median CPU µs per request)."""
    pier, base, low = cpu[PIER], cpu[bare], cpu[layer]
    budget = base / target
    return (f"{title} c={c}: server CPU per request Pier {pier:,.0f} µs = its protocol layer ({layer}: "
            f"{low:,.0f} µs) + its own work ({pier - low:,.0f} µs); {bare} {base:,.0f} µs. At {target}× {bare} "
            f"(at most {budget:,.0f} µs per request) Pier's own work may cost {budget - low:,.0f} µs.")


def budget_notes(group: report.Group, bare: str, layer: str, target: float) -> list[str]:
    notes = []
    for c in CONCURRENCY:
        cpu = {name: v for name in (PIER, bare, layer) if (v := _cpu(group, name, c)) is not None}
        if len(cpu) == 3:
            notes.append(budget_note(group.title.split(",")[0], c, cpu, bare, layer, target))
    return notes


def run(settings: Settings) -> Path:
    pa = perf_analyzer_required()
    started = report.started_info()
    http = report.Group("HTTP (Triton binary tensors), batch 1, INPUT0 [16] FP32", "concurrency", "infer/s",
                        [PIER, BARE_HTTP, RAW_HTTP], CONCURRENCY, refs=[BARE_HTTP], subject="")
    grpc = report.Group("gRPC, batch 1, INPUT0 [16] FP32", "concurrency", "infer/s",
                        [PIER, BARE_GRPC, GENERIC_GRPC], CONCURRENCY, refs=[BARE_GRPC], subject="")
    notes: list[str] = []
    with Servers() as servers, temp_dir("floor-") as tmp:
        shutil.copytree(ROOT / "model_repository" / MODEL, tmp / MODEL)
        up = {
            PIER: servers.add(PIER, lambda: start_pier("pier_floor", tmp), required=True),
            BARE_HTTP: servers.add(BARE_HTTP, start_bare_http),
            RAW_HTTP: servers.add(RAW_HTTP, start_raw_http),
            BARE_GRPC: servers.add(BARE_GRPC, start_bare_grpc),
            GENERIC_GRPC: servers.add(GENERIC_GRPC, start_generic_grpc),
        }
        notes += servers.left_out_notes()
        identity_rounds(pa, settings, [(http, "http"), (grpc, "grpc")], up, notes)
    # Pier answers a plain infer below aiohttp's web layer (server/frontends/http/fastpath.py), and on
    # grpc.aio's generated servicer
    notes += budget_notes(http, BARE_HTTP, RAW_HTTP, 0.8) + budget_notes(grpc, BARE_GRPC, BARE_GRPC, 0.85)
    targets = [
        grpc.target(f"gRPC c={c}: the generic handler answers ≥ 1.05× the generated servicer (worth adopting)",
                    GENERIC_GRPC, c, BARE_GRPC, 1.05) for c in CONCURRENCY
    ]
    intro = [
        "perf_analyzer 2.51 (sync, batch 1, random FP32 data, `--shape INPUT0:16`) on the same 2 shared cores as "
        "the servers (server, perf_analyzer and the model share them). Pier serves the example "
        "`model_repository/identity_fp32` with its default settings (ONNX Identity, "
        "`dynamic_batching { max_queue_delay_microseconds: 100 }`); the other rows echo the input with no "
        "validation, queue, batching or statistics. `bare aiohttp` / `bare grpc.aio`: python-limit's servers, the "
        "limit issue 30 measures Pier against; `raw httptools`: bench/floor/raw_http.py, the same echo with no "
        "aiohttp web layer; `generic handler`: bench/floor/generic_grpc.py, ModelInfer answered with hand-written "
        "protobuf bytes.",
        "`server CPU µs/req`: the CPU time of every process of the server over the whole perf_analyzer run, per "
        "request (Pier: counted by its statistics; the echo servers keep none, so throughput × duration).",
    ]
    return report.write("protocol_floor", "Issue 30: the protocol layers' floor beside Pier", settings, [http, grpc],
                        targets, intro, notes, started)


def main(argv: list[str] | None = None) -> int:
    return report.settings_main("bench.protocol_floor", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
