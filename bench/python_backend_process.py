"""Python-backend identity model (issue 22 part 3): Pier running it in a stub process (the
default) vs Pier running it in the server process (`execution_mode: in_process`) vs Triton 2.51's
python backend (a stub process per instance). Latency at concurrency 1 and throughput at
concurrency 8 over HTTP and gRPC with a 64-byte tensor, and over gRPC with 1 MiB tensors (Pier's
memfd path, Triton's shared-memory pool). perf_analyzer when available, else a tritonclient
loop; interleaved rounds, the median round in the table and each round listed.

    .venv/bin/python -m bench.python_backend_process            # 3 rounds (~10 min)
    .venv/bin/python -m bench.python_backend_process --quick    # 1 round, short windows

Writes bench/results/python_backend_process[-quick].{md,json,png}. Triton needs
PIER_REFERENCE_TOOLS (its triton-reference/): without it that row is skipped with a note.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench import report
from bench.common import Settings, log, temp_dir
from bench.measure import Point, perf_analyzer_point
from bench.server_cpu import metered
from bench.servers import Server, Servers, measure, round_order, start_pier, triton_reference_starter
from bench.tools import perf_analyzer

PROCESS, IN_PROCESS, TRITON = "Pier, process", "Pier, in-process", "Triton 2.51"
CONCURRENCY = [1, 8]
MODEL = "identity_fp32"
BIG = 262144  # FP32 elements: 1 MiB each way

# The reference Triton's identity_fp32, as its triton-reference/models/ holds it (so that Pier's rows
# need no reference tools): same code, same config, Pier's mode as a parameter.
MODEL_PY = '''"""Triton python-backend model: OUTPUT0 = INPUT0 (FP32, shape [batch, -1])."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
'''
CONFIG = """name: "identity_fp32"
backend: "python"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "execution_mode" value { string_value: "%s" } }
"""


def _repo(root: Path, mode: str) -> Path:
    (root / MODEL / "1").mkdir(parents=True)
    (root / MODEL / "1" / "model.py").write_text(MODEL_PY)
    (root / MODEL / "config.pbtxt").write_text(CONFIG % mode)
    return root


def client_point(server: Server, protocol: str, concurrency: int, elements: int, settings: Settings) -> Point:
    """tritonclient (HTTP or gRPC), `concurrency` threads each with its own client, closed loop, for
    settings.loadgen_s after settings.warmup_s (the fallback without perf_analyzer)."""
    if protocol == "http":
        import tritonclient.http as mod
    else:
        import tritonclient.grpc as mod  # type: ignore[no-redef]
    url = server.http if protocol == "http" else server.grpc
    data = np.random.default_rng(0).random((1, elements), dtype=np.float32)
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    start = threading.Barrier(concurrency + 1)
    window = [0.0, 0.0]

    def loop(i: int) -> None:
        client = mod.InferenceServerClient(url)
        inp = mod.InferInput("INPUT0", [1, elements], "FP32")
        inp.set_data_from_numpy(data)
        start.wait()
        while time.perf_counter() < window[1]:
            t0 = time.perf_counter()
            try:
                client.infer(MODEL, [inp])
            except Exception:
                errors[i] += 1
                continue
            if t0 >= window[0]:
                latencies[i].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    now = time.perf_counter()
    window[0], window[1] = now + settings.warmup_s, now + settings.warmup_s + settings.loadgen_s
    start.wait()
    for t in threads:
        t.join()
    us = np.asarray([x for lat in latencies for x in lat]) * 1e6
    return Point(throughput=len(us) / settings.loadgen_s, p50_us=float(np.percentile(us, 50)),
                 p90_us=float(np.percentile(us, 90)), p99_us=float(np.percentile(us, 99)),
                 avg_us=float(us.mean()), count=len(us), errors=sum(errors))


def run(settings: Settings) -> Path:
    pa = perf_analyzer()
    started = report.started_info()
    small = "INPUT0 [16] FP32"
    groups = [
        report.Group(f"HTTP (binary tensors), batch 1, {small}", "concurrency", "infer/s",
                     [PROCESS, IN_PROCESS, TRITON], CONCURRENCY, refs=[TRITON, IN_PROCESS]),
        report.Group(f"gRPC, batch 1, {small}", "concurrency", "infer/s", [PROCESS, IN_PROCESS, TRITON],
                     CONCURRENCY, refs=[TRITON, IN_PROCESS]),
        report.Group("gRPC, batch 1, INPUT0 [262144] FP32 (1 MiB each way)", "concurrency", "infer/s",
                     [PROCESS, IN_PROCESS, TRITON], CONCURRENCY, refs=[TRITON, IN_PROCESS]),
    ]
    points = [(groups[0], "http", 16), (groups[1], "grpc", 16), (groups[2], "grpc", BIG)]
    notes: list[str] = []
    if pa is None:
        notes.append("perf_analyzer not available: tritonclient loops (one client per thread, closed loop) "
                     "drive the servers instead")
    with Servers() as servers, temp_dir("pyproc-") as tmp:
        start_triton_identity = triton_reference_starter(MODEL, tmp / "triton")

        up = {
            PROCESS: servers.add(PROCESS, lambda: start_pier("pier_py_process", _repo(tmp / "process", "process")),
                                 required=True),
            IN_PROCESS: servers.add(IN_PROCESS, lambda: start_pier("pier_py_in_process",
                                                                   _repo(tmp / "in_process", "in_process")),
                                    required=True),
            TRITON: servers.add(TRITON, start_triton_identity),
        }
        notes += servers.left_out_notes()
        for rnd in range(settings.rounds):
            for group, proto, elements in points:
                names = round_order(group.servers, up, rnd)
                for c in CONCURRENCY:
                    for name in names:
                        srv = up[name]
                        assert srv is not None
                        label = f"round {rnd + 1} {proto} [{elements}] c={c} {name}"

                        def one(s: Server = srv, p: str = proto, c: int = c, n: int = elements,
                                lb: str = label) -> Point:
                            if pa is None:
                                return client_point(s, p, c, n, settings)
                            url = s.http if p == "http" else s.grpc
                            assert url is not None
                            return metered(s, MODEL, lambda: perf_analyzer_point(
                                pa, settings, MODEL, url, p, c, ["--shape", f"INPUT0:{n}"], lb))

                        pt = measure(srv, one, label, notes)
                        if pt is None:
                            continue
                        cpu = f", server CPU {pt.server_cpu_us:,.0f} µs/req" if pt.server_cpu_us else ""
                        log(f"{label}: {pt.throughput:,.0f} infer/s p50 {pt.p50_us / 1000:.2f} ms "
                            f"p99 {pt.p99_us / 1000:.2f} ms{cpu}{'' if pt.stable else ' (unstable)'}")
                        group.add(name, c, pt)

    # The default's rule (issue 22): the isolation may cost at most 30 % of in-process throughput on the
    # small-tensor points; Triton (which always runs a stub) is a reading, not a target, since Pier's
    # Python frontends are slower than Triton's C++ ones even in-process.
    targets = [group.target(f"{group.title.split(',')[0].split(' ')[0]} c={c}: Pier process ≥ 0.7× Pier in-process",
                            PROCESS, c, IN_PROCESS, 0.7) for group in groups[:2] for c in CONCURRENCY]
    # Issue 30: the model in its stub at least as fast as Triton's python backend at c=8.
    targets += [group.target(f"{group.title.split(',')[0].split(' ')[0]} c=8: Pier process ≥ 1.0× Triton 2.51",
                             PROCESS, 8, TRITON, 1.0) for group in groups[:2]]
    spread_notes = []
    for group in groups:
        for c in CONCURRENCY:
            for name in group.servers:
                rounds = [p.p50_us for p in group.data.get((name, c), [])]
                if len(rounds) > 1:
                    spread_notes.append(f"{group.title.split(',')[0]} c={c} {name}: p50 per round "
                                        + " / ".join(f"{r / 1000:.2f}" for r in rounds) + " ms (median "
                                        f"{statistics.median(rounds) / 1000:.2f})")
    intro = [
        "The same python-backend identity model (Triton's reference `identity_fp32`: `OUTPUT0 = INPUT0`, "
        "`max_batch_size: 64`, `dynamic_batching { max_queue_delay_microseconds: 100 }`, one CPU instance) "
        "served three ways on the same 2-core machine as the load generator: Pier with the model in its "
        "own stub process (`execution_mode: process`, the default: a SOCK_SEQPACKET socketpair per channel, "
        "tensors over 64 KiB in a reusable memfd region, copied once each way), Pier with the model in the "
        "server process (`execution_mode: in_process`), and Triton 2.51's python backend (a stub process with a "
        "shared-memory message queue). "
        + ("perf_analyzer 2.51 (sync, batch 1, random data)." if pa is not None else
           "tritonclient loops (perf_analyzer was not available)."),
        "Latency: the c=1 rows (p50/p99); throughput: the c=8 rows. The `vs` columns are Pier-row ratios "
        "(median of the per-round ratios). `server CPU µs/req`: every process of the server (the stubs too) "
        "per request its statistics counted (bench/server_cpu.py).",
    ]
    return report.write("python_backend_process", "Python backend: stub process vs in-process vs Triton 2.51",
                        settings, groups, targets, intro, notes + spread_notes, started)


def main(argv: list[str] | None = None) -> int:
    return report.settings_main("bench.python_backend_process", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
