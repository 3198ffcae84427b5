"""`--frontend-processes N` (issue 22 part 2), side by side in one run:

- identity_fp32 (batch 1, INPUT0 [16] FP32), perf_analyzer over HTTP (binary tensors) and gRPC at
  concurrency 1, 8 and 32: Pier in one process (the default), Pier with 1, 2 and 4 frontend
  processes, and the reference Triton 2.51 (its python-backend identity_fp32, same config);
- text_embedding (MiniLM, dynamic batching) at concurrency 32 over HTTP: Pier in one process and
  with 2 frontend processes vs onnxruntime called in-process at batch 32.

Interleaved rounds (the order rotates per round), the median round in the tables, ratios as the
median of per-round ratios.

    .venv/bin/python -m bench.frontend_processes            # 3 rounds (~25 min)
    .venv/bin/python -m bench.frontend_processes --quick    # 1 round, short windows

Writes bench/results/frontend_processes[-quick].{md,json,png}. Triton needs PIER_REFERENCE_TOOLS
(its triton-reference/): without it that row is skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from bench import report, text_embedding
from bench.common import ROOT, Settings, log, temp_dir
from bench.measure import perf_analyzer_point, timed_loop
from bench.servers import Server, Servers, measure, round_order, start_pier, triton_reference_starter
from bench.tools import perf_analyzer_required

PIER, TRITON = "Pier, one process", "Triton 2.51"
FRONTENDS = {1: "Pier, 1 frontend process", 2: "Pier, 2 frontend processes", 4: "Pier, 4 frontend processes"}
PIERS = [PIER, *FRONTENDS.values()]
CONCURRENCY = [1, 8, 32]
MODEL = "identity_fp32"
EMBED_PIER, EMBED_FRONTENDS, EMBED_DIRECT = "Pier, one process", "Pier, 2 frontend processes", "onnxruntime direct"
EMBED_LEVEL = 32


def _identity(settings: Settings, pa: Path, servers: Servers, tmp: Path, notes: list[str]) -> list[report.Group]:
    http = report.Group("identity_fp32 over HTTP (binary tensors), batch 1, INPUT0 [16] FP32", "concurrency",
                        "infer/s", [*PIERS, TRITON], CONCURRENCY, refs=[TRITON, PIER])
    grpc = report.Group("identity_fp32 over gRPC, batch 1, INPUT0 [16] FP32", "concurrency", "infer/s",
                        [*PIERS, TRITON], CONCURRENCY, refs=[TRITON, PIER])
    repo = tmp / "pier"
    shutil.copytree(ROOT / "model_repository" / MODEL, repo / MODEL)
    start_triton_identity = triton_reference_starter(MODEL, tmp / "triton")
    up: dict[str, Server | None] = {PIER: servers.add(PIER, lambda: start_pier("pier_one_process", repo),
                                                      required=True)}
    for n, name in FRONTENDS.items():
        up[name] = servers.add(name, lambda n=n: start_pier(f"pier_frontends_{n}", repo, f"--frontend-processes={n}"),
                               required=True)
    up[TRITON] = servers.add(TRITON, start_triton_identity)
    notes += servers.left_out_notes()
    for rnd in range(settings.rounds):
        for group, proto in ((http, "http"), (grpc, "grpc")):
            names = round_order(group.servers, up, rnd)
            for c in CONCURRENCY:
                for name in names:
                    srv = up[name]
                    assert srv is not None
                    label = f"round {rnd + 1} {proto} c={c} {name}"
                    url = srv.http if proto == "http" else srv.grpc
                    assert url is not None
                    pt = measure(srv, lambda u=url, p=proto, c=c, lb=label: perf_analyzer_point(
                        pa, settings, MODEL, u, p, c, ["--shape", "INPUT0:16"], lb), label, notes)
                    if pt is None:
                        continue
                    log(f"{label}: {pt.throughput:,.0f} infer/s p50 {pt.p50_us / 1000:.2f} ms "
                        f"p99 {pt.p99_us / 1000:.2f} ms{'' if pt.stable else ' (unstable)'}")
                    group.add(name, c, pt)
    return [http, grpc]


def _embedding(settings: Settings, pa: Path, servers: Servers, tmp: Path, notes: list[str]) -> report.Group:
    import onnxruntime as ort

    from bench.tokenization import Tokenizer, fixed_length_inputs

    group = report.Group(f"text_embedding, {text_embedding.SEQ_LEN}-token sentences, dynamic batching: sequences/s",
                         "concurrency / batch", "seq/s", [EMBED_PIER, EMBED_FRONTENDS, EMBED_DIRECT], [EMBED_LEVEL],
                         refs=[EMBED_DIRECT], x_labels={EMBED_PIER: "c", EMBED_FRONTENDS: "c", EMBED_DIRECT: "batch"})
    model_file = text_embedding.ensure_model()
    tok = Tokenizer(max_length=text_embedding.SEQ_LEN)
    ids, mask = fixed_length_inputs(EMBED_LEVEL * 2, text_embedding.SEQ_LEN, tok)
    sess = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    text_embedding.build_repo(tmp / "embed", model_file)
    data = tmp / "input_data.json"
    text_embedding.write_input_data(data, ids, mask)
    up = {EMBED_PIER: servers.add("embedding, one process", lambda: start_pier("pier_embed", tmp / "embed"),
                                  required=True),
          EMBED_FRONTENDS: servers.add("embedding, 2 frontends", lambda: start_pier(
              "pier_embed_frontends", tmp / "embed", "--frontend-processes=2"), required=True)}
    window_ms = settings.window_ms * 2  # a request takes milliseconds here: longer windows
    feed = {"input_ids": ids[:EMBED_LEVEL], "attention_mask": mask[:EMBED_LEVEL]}
    for rnd in range(settings.rounds):
        pt = timed_loop(lambda: sess.run(["embedding"], feed), settings.loadgen_s, max(1.0, settings.warmup_s),
                        max_calls=100_000, items_per_call=EMBED_LEVEL)
        log(f"round {rnd + 1} direct ORT batch {EMBED_LEVEL}: {pt.throughput:,.1f} seq/s")
        group.add(EMBED_DIRECT, EMBED_LEVEL, pt)
        order = [EMBED_PIER, EMBED_FRONTENDS] if rnd % 2 == 0 else [EMBED_FRONTENDS, EMBED_PIER]
        for name in order:
            srv = up[name]
            assert srv is not None and srv.http is not None
            label = f"round {rnd + 1} embedding c={EMBED_LEVEL} {name}"
            got = measure(srv, lambda u=srv.http, lb=label: perf_analyzer_point(
                pa, settings, text_embedding.MODEL, u, "http", EMBED_LEVEL, ["--input-data", str(data)], lb,
                window_ms=window_ms), label, notes)
            if got is not None:
                log(f"{label}: {got.throughput:,.1f} seq/s")
                group.add(name, EMBED_LEVEL, got)
    return group


def run(settings: Settings, embedding: bool = True) -> Path:
    pa = perf_analyzer_required()
    started = report.started_info()
    notes: list[str] = []
    with Servers() as servers, temp_dir("frontends-") as tmp:
        groups = _identity(settings, pa, servers, tmp, notes)
    if embedding:
        with Servers() as servers, temp_dir("frontends-embed-") as tmp:
            groups.append(_embedding(settings, pa, servers, tmp, notes))
    http, grpc = groups[0], groups[1]
    targets = [g.target(f"{proto} c=8: {name} ≥ 1.0× Triton", name, 8, TRITON, 1.0)
               for g, proto in ((http, "HTTP"), (grpc, "gRPC")) for name in PIERS]
    targets += [g.target(f"{proto} c=1: {name} ≥ 0.9× {PIER}", name, 1, PIER, 0.9)
                for g, proto in ((http, "HTTP"), (grpc, "gRPC")) for name in FRONTENDS.values()]
    if embedding:
        targets += [groups[2].target(f"text_embedding c=32: {name} ≥ 0.85× onnxruntime batch 32", name, EMBED_LEVEL,
                                     EMBED_DIRECT, 0.85) for name in (EMBED_PIER, EMBED_FRONTENDS)]
    intro = [
        f"perf_analyzer 2.51 (sync, batch 1) on the same {os.cpu_count()}-core machine as the servers. "
        "`Pier, one process` is the default (HTTP and gRPC served by the process that runs the models); "
        "`N frontend processes` is `--frontend-processes N`: N processes share the ports (SO_REUSEPORT), "
        "decode and encode inference requests and hand them to the server process over a SOCK_SEQPACKET "
        "socketpair each (tensors over 64 KiB through a memfd). Pier serves the example "
        "`model_repository/identity_fp32` (ONNX Identity, `max_queue_delay_microseconds: 100`); Triton serves "
        "its python-backend `identity_fp32` (same config).",
        "SO_REUSEPORT spreads connections, not requests: perf_analyzer's HTTP client opens one connection "
        "per concurrent request, its gRPC client shares one connection among all of them, so over gRPC one "
        "frontend process takes the whole load whatever N is.",
    ]
    return report.write("frontend_processes", "Frontend processes: Pier with 0/1/2/4 frontends vs Triton 2.51",
                        settings, groups, targets, intro, notes, started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-embedding", action="store_true", help="identity_fp32 only")
    args = ap.parse_args()
    path = run(Settings.make(args.quick, args.rounds), embedding=not args.no_embedding)
    print(path)


if __name__ == "__main__":
    sys.exit(main())
