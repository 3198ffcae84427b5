"""(b) identity_fp32, batch 1, INPUT0 [16] FP32, perf_analyzer over HTTP (binary tensors) and gRPC at
concurrency 1 and 8: Pier vs the reference Triton 2.51 (python-backend identity_fp32) vs the bare
Python servers (bare_http.py / bare_grpc.py --uvloop). All servers run at once (idle while the
others are measured); every (protocol, concurrency) point is measured for all of them back to back,
and the order rotates between rounds."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench import report
from bench.common import ROOT, Settings, log, temp_dir
from bench.measure import Point, perf_analyzer_point
from bench.server_cpu import metered
from bench.servers import (
    Server,
    Servers,
    copy_without_queue_delay,
    measure,
    round_order,
    start_bare_grpc,
    start_bare_http,
    start_pier,
    triton_reference_starter,
)
from bench.tools import perf_analyzer_required

PIER, TRITON, BARE_HTTP, BARE_GRPC = "Pier", "Triton 2.51", "bare aiohttp", "bare grpc.aio"
PIER_NO_DELAY = "Pier, no queue delay"
CONCURRENCY = [1, 8]
MODEL = "identity_fp32"


def identity_point(pa: Path, settings: Settings, server: Server, protocol: str, concurrency: int, label: str,
                   notes: list[str]) -> Point | None:
    """One perf_analyzer point on `MODEL` (batch 1, INPUT0 [16]) with the server's CPU per request; logged,
    None (and a note) when it could not be measured."""
    url = server.http if protocol == "http" else server.grpc
    assert url is not None, f"{server.name} has no {protocol} port"
    pt = measure(server, lambda: metered(server, MODEL, lambda: perf_analyzer_point(
        pa, settings, MODEL, url, protocol, concurrency, ["--shape", "INPUT0:16"], label)), label, notes)
    if pt is not None:
        cpu = f", server CPU {pt.server_cpu_us:,.0f} µs/req" if pt.server_cpu_us else ""
        log(f"{label}: {pt.throughput:,.0f} infer/s p50 {pt.p50_us / 1000:.2f} ms "
            f"p99 {pt.p99_us / 1000:.2f} ms{cpu}{'' if pt.stable else ' (unstable)'}")
    return pt


def identity_rounds(pa: Path, settings: Settings, groups: list[tuple[report.Group, str]],
                    up: dict[str, Server | None], notes: list[str]) -> None:
    """settings.rounds interleaved rounds of every (group, protocol) at each concurrency, the started
    servers of a group back to back in an order that rotates each round."""
    for rnd in range(settings.rounds):
        for group, proto in groups:
            names = round_order(group.servers, up, rnd)
            for c in CONCURRENCY:
                for name in names:
                    server = up[name]
                    assert server is not None
                    group.add(name, c, identity_point(pa, settings, server, proto, c,
                                                      f"round {rnd + 1} {proto} c={c} {name}", notes))


def run(settings: Settings) -> Path:
    pa = perf_analyzer_required()
    started = report.started_info()
    http = report.Group("HTTP (Triton binary tensors), batch 1, INPUT0 [16] FP32", "concurrency", "infer/s",
                        [PIER, PIER_NO_DELAY, TRITON, BARE_HTTP], CONCURRENCY, refs=[TRITON, BARE_HTTP])
    grpc = report.Group("gRPC, batch 1, INPUT0 [16] FP32", "concurrency", "infer/s",
                        [PIER, PIER_NO_DELAY, TRITON, BARE_GRPC], CONCURRENCY, refs=[TRITON, BARE_GRPC])
    notes: list[str] = []
    with Servers() as servers, temp_dir("identity-") as tmp:
        pier_repo, triton_repo = tmp / "pier", tmp / "triton"
        shutil.copytree(ROOT / "model_repository" / MODEL, pier_repo / MODEL)
        copy_without_queue_delay(ROOT / "model_repository" / MODEL, tmp / "pier_no_delay" / MODEL)
        start_triton_identity = triton_reference_starter(MODEL, triton_repo)

        up = {
            PIER: servers.add(PIER, lambda: start_pier("pier_identity", pier_repo), required=True),
            PIER_NO_DELAY: servers.add(PIER_NO_DELAY, lambda: start_pier("pier_identity_no_delay",
                                                                         tmp / "pier_no_delay")),
            TRITON: servers.add(TRITON, start_triton_identity),
            BARE_HTTP: servers.add(BARE_HTTP, start_bare_http),
            BARE_GRPC: servers.add(BARE_GRPC, start_bare_grpc),
        }
        notes += servers.left_out_notes()
        identity_rounds(pa, settings, [(http, "http"), (grpc, "grpc")], up, notes)

    targets = [  # issue 30: Pier at the Python limit (≥ 0.8× bare aiohttp, ≥ 0.85× bare grpc.aio)
        http.target("HTTP c=1: Pier ≥ 0.8× bare aiohttp", PIER, 1, BARE_HTTP, 0.8),
        http.target("HTTP c=8: Pier ≥ 0.8× bare aiohttp", PIER, 8, BARE_HTTP, 0.8),
        grpc.target("gRPC c=1: Pier ≥ 0.85× bare grpc.aio", PIER, 1, BARE_GRPC, 0.85),
        grpc.target("gRPC c=8: Pier ≥ 0.85× bare grpc.aio", PIER, 8, BARE_GRPC, 0.85),
        http.target("HTTP c=1: Pier ≥ 1.0× Triton", PIER, 1, TRITON, 1.0),
        http.target("HTTP c=8: Pier ≥ 1.0× Triton", PIER, 8, TRITON, 1.0),
        grpc.target("gRPC c=1: Pier ≥ 1.0× Triton", PIER, 1, TRITON, 1.0),
    ]
    intro = [
        "perf_analyzer 2.51 (sync, batch 1, random FP32 data, `--shape INPUT0:16`) on the same 2-core "
        "machine as the servers. Pier serves the example `model_repository/identity_fp32` "
        "(ONNX Identity, `dynamic_batching { max_queue_delay_microseconds: 100 }`); Triton serves its "
        "python-backend `identity_fp32` (same config); the bare servers "
        "(`$PIER_REFERENCE_TOOLS/python-limit`, `--uvloop`) echo the input with no validation, queue, batching "
        "or statistics: the Python ceiling.",
        "`Pier, no queue delay` is the same Pier with `max_queue_delay_microseconds: 0`, for reading only (no "
        "target uses it): the gap between the two Pier rows is what the configured 100 µs batching wait costs, "
        "which Triton pays too and the bare servers (no batching) do not.",
        "`server CPU µs/req`: the CPU time of every process of the server (its children too: Triton's python "
        "stubs) over the whole perf_analyzer run, per request its own statistics counted (`*`: the bare servers "
        "keep none, so throughput × duration); the rounds' median (min–max). The figure that carries to a larger "
        "machine: on these 2 shared cores (server, perf_analyzer and model on the same two) throughput is capped "
        "by whichever process holds a core.",
    ]
    return report.write("identity_fp32", "identity_fp32: Pier vs Triton 2.51 vs bare Python servers", settings,
                        [http, grpc], targets, intro, notes, started)
