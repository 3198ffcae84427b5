"""(a) text_embedding (all-MiniLM-L6-v2, fixed 32-token sentences): Pier with dynamic batching vs
Pier without (the same model, its dynamic_batching section removed) vs onnxruntime called directly in
this process at batch 1, 8, 32 (the limit). Pier is driven by perf_analyzer over HTTP (its default
protocol, binary tensors) with real token ids (`--input-data` JSON), one sentence per request, at
concurrency 1, 8, 32, plus gRPC at the two target points (batched c=32, unbatched c=1); everything is
reported in sequences/s. Points are interleaved: for each level, direct ORT, then the Pier rows."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import report
from bench.common import ROOT, Settings, log, temp_dir
from bench.measure import Point, alternate, perf_analyzer_point, timed_loop
from bench.server_cpu import model_stats
from bench.servers import Server, Servers, measure, start_pier
from bench.tools import perf_analyzer_required

MODEL = "text_embedding"
NOBATCH = "text_embedding_nobatch"
SRC = ROOT / "model_repository" / MODEL
LEVELS = [1, 8, 32]
SEQ_LEN = 32
BATCHED, UNBATCHED, DIRECT = "Pier (dynamic batching)", "Pier (no batching)", "onnxruntime direct"
BATCHED_GRPC, UNBATCHED_GRPC = "Pier (dynamic batching) over gRPC", "Pier (no batching) over gRPC"
GRPC_POINTS = {32: (BATCHED_GRPC, MODEL), 1: (UNBATCHED_GRPC, NOBATCH)}  # the targets' points, over gRPC too


def ensure_model() -> Path:
    """The exported ONNX file, built with scripts/export_text_embedding.py when missing."""
    path = SRC / "1" / "model.onnx"
    if not path.exists():
        log(f"{path.relative_to(ROOT)} missing: exporting it (scripts/export_text_embedding.py)")
        import sys

        sys.path.insert(0, str(ROOT))
        from scripts.export_text_embedding import export

        export(ROOT / "model_repository")
    return path


def strip_dynamic_batching(config: str) -> str:
    """Remove the `dynamic_batching { ... }` block (nested braces allowed) from a config.pbtxt."""
    m = re.search(r"^\s*dynamic_batching\s*:?\s*\{", config, flags=re.M)
    if not m:
        return config
    depth, i = 0, m.end() - 1
    while i < len(config):
        depth += {"{": 1, "}": -1}.get(config[i], 0)
        i += 1
        if depth == 0:
            break
    return config[: m.start()] + "\n" + config[i:].lstrip("\n")


def _queue_delay() -> str:
    m = re.search(r"max_queue_delay_microseconds\s*:\s*(\d+)", (SRC / "config.pbtxt").read_text())
    return m.group(1) if m else "0"


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_repo(repo: Path, model_file: Path) -> str:
    config = (SRC / "config.pbtxt").read_text()
    if "dynamic_batching" not in config:
        raise RuntimeError(f"{SRC / 'config.pbtxt'} has no dynamic_batching section")
    (repo / MODEL).mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text(config)
    _link(model_file, repo / MODEL / "1" / "model.onnx")
    nobatch = strip_dynamic_batching(config).replace(f'name: "{MODEL}"', f'name: "{NOBATCH}"')
    if "dynamic_batching" in nobatch or NOBATCH not in nobatch:
        raise RuntimeError("could not derive the no-batching config")
    (repo / NOBATCH).mkdir(parents=True)
    (repo / NOBATCH / "config.pbtxt").write_text(nobatch)
    _link(model_file, repo / NOBATCH / "1" / "model.onnx")
    return nobatch


def batch_counts(server: Server, model: str) -> Counter[int]:
    """Executions per batch size in the server's statistics (KServe-v2 `batch_stats`)."""
    try:
        return Counter({b["batch_size"]: b["compute_infer"]["count"]
                        for m in model_stats(server, model) for b in m.get("batch_stats", [])})
    except (KeyError, TypeError, AttributeError):
        return Counter()


def noting_batches(pier: Server, model: str, label: str, notes: list[str], fn: Callable[[], Point | None]
                   ) -> Point | None:
    """`fn()`, with the batches `model` formed meanwhile in `notes`: '26 x203, 6 x203 (mean 16.0)',
    most first (from the server's batch_stats)."""
    before = batch_counts(pier, model)
    pt = fn()
    formed = batch_counts(pier, model) - before
    text = "none counted"
    if formed:
        mean = sum(size * n for size, n in formed.items()) / formed.total()
        text = ", ".join(f"{size} x{n}" for size, n in formed.most_common(6)) + f" (mean {mean:.1f})"
    notes.append(f"{label}: batches formed {text}")
    return pt


def measure_both(group: report.Group, pier: Server, rnd: int, level: int, notes: list[str],
                 point: Callable[[str, int, str], Point]) -> None:
    """One point each for the batched and the unbatched model at concurrency `level` (their order
    alternates by round); `point(model, concurrency, label)` measures. The batches the batched
    model formed go to `notes`."""
    for name, model in alternate([(BATCHED, MODEL), (UNBATCHED, NOBATCH)], rnd):
        label = f"round {rnd + 1} c={level} {name}"
        def one(m: str = model, lb: str = label) -> Point | None:
            return measure(pier, lambda: point(m, level, lb), lb, notes)

        pt = noting_batches(pier, model, label, notes, one) if model == MODEL and level > 1 else one()
        if pt is None:
            continue
        log(f"{label}: {pt.throughput:,.1f} seq/s p50 {pt.p50_us / 1000:.2f} ms "
            f"p99 {pt.p99_us / 1000:.2f} ms{'' if pt.stable else ' (unstable)'}")
        group.add(name, level, pt)


def batching_targets(group: report.Group, direct: str, direct_text: str) -> list[report.Target]:
    """The issue's two targets, relative to calling the model directly."""
    return [
        group.target(f"Pier with batching at c=32 ≥ 0.85× {direct_text} at batch 32", BATCHED, 32, direct, 0.85),
        group.target(f"Pier without batching at c=1 ≥ 0.85× {direct_text} at batch 1", UNBATCHED, 1, direct, 0.85),
    ]


def write_input_data(path: Path, ids: np.ndarray, mask: np.ndarray) -> None:
    rows = [{"input_ids": {"content": i.tolist(), "shape": [SEQ_LEN]},
             "attention_mask": {"content": m.tolist(), "shape": [SEQ_LEN]}} for i, m in zip(ids, mask)]
    path.write_text(json.dumps({"data": rows}))


def check_server(url: str, model: str, ids: np.ndarray, mask: np.ndarray, expected: np.ndarray) -> float:
    """One gRPC request per row; returns the lowest cosine similarity with direct onnxruntime."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        worst = 1.0
        for row in range(len(ids)):
            inputs = [grpcclient.InferInput("input_ids", [1, SEQ_LEN], "INT64"),
                      grpcclient.InferInput("attention_mask", [1, SEQ_LEN], "INT64")]
            inputs[0].set_data_from_numpy(ids[row : row + 1])
            inputs[1].set_data_from_numpy(mask[row : row + 1])
            got = client.infer(model, inputs, client_timeout=60).as_numpy("embedding")[0]
            ref = expected[row]
            worst = min(worst, float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref))))
        return worst
    finally:
        client.close()


def run(settings: Settings) -> Path:
    import onnxruntime as ort

    from bench.tokenization import Tokenizer, fixed_length_inputs

    pa = perf_analyzer_required()
    model_file = ensure_model()
    started = report.started_info()
    tok = Tokenizer(max_length=SEQ_LEN)
    ids, mask = fixed_length_inputs(max(LEVELS) * 2, SEQ_LEN, tok)
    group = report.Group(f"text_embedding, {SEQ_LEN}-token sentences: sequences/s", "concurrency / batch",
                         "seq/s", [BATCHED, UNBATCHED, BATCHED_GRPC, UNBATCHED_GRPC, DIRECT], LEVELS,
                         refs=[DIRECT, UNBATCHED],
                         x_labels={BATCHED: "c", UNBATCHED: "c", BATCHED_GRPC: "c", UNBATCHED_GRPC: "c",
                                   DIRECT: "batch"})
    notes: list[str] = []
    # Same session options as Pier's onnxruntime backend (defaults: no thread parameters in the config).
    sess = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    expected = sess.run(["embedding"], {"input_ids": ids[:8], "attention_mask": mask[:8]})[0]
    window_ms = settings.window_ms * 2  # a request takes milliseconds here: longer windows
    with Servers() as servers, temp_dir("embedding-") as tmp:
        build_repo(tmp / "repo", model_file)
        data = tmp / "input_data.json"
        write_input_data(data, ids, mask)
        pier = servers.add("Pier", lambda: start_pier("pier_text_embedding", tmp / "repo"), required=True)
        for model in (MODEL, NOBATCH):
            cos = check_server(pier.grpc, model, ids[:8], mask[:8], expected)
            notes.append(f"check: Pier `{model}` over gRPC vs direct onnxruntime, 8 sentences: min cosine {cos:.6f}")
            if cos < 0.999:
                raise RuntimeError(f"Pier's {model} answers differ from onnxruntime (cosine {cos})")
        for rnd in range(settings.rounds):
            for level in LEVELS:
                feed = {"input_ids": ids[:level], "attention_mask": mask[:level]}
                pt = timed_loop(lambda f=feed: sess.run(["embedding"], f), settings.loadgen_s,
                                max(1.0, settings.warmup_s), max_calls=100_000, items_per_call=level)
                log(f"round {rnd + 1} direct ORT batch {level}: {pt.throughput:,.1f} seq/s "
                    f"p50 {pt.p50_us / 1000:.1f} ms/call")
                group.add(DIRECT, level, pt)
                measure_both(group, pier, rnd, level, notes, lambda m, c, lb: perf_analyzer_point(
                    pa, settings, m, pier.http, "http", c, ["--input-data", str(data)], lb, window_ms=window_ms))
                if level in GRPC_POINTS:
                    name, model = GRPC_POINTS[level]
                    label = f"round {rnd + 1} c={level} {name}"
                    def over_grpc(m: str = model, c: int = level, lb: str = label) -> Point | None:
                        return measure(pier, lambda: perf_analyzer_point(
                            pa, settings, m, pier.grpc, "grpc", c, ["--input-data", str(data)], lb,
                            window_ms=window_ms), lb, notes)

                    pt = noting_batches(pier, model, label, notes, over_grpc) if model == MODEL else over_grpc()
                    if pt is not None:
                        log(f"{label}: {pt.throughput:,.1f} seq/s")
                        group.add(name, level, pt)

    targets = batching_targets(group, DIRECT, "direct ORT") + [
        group.target("issue 30: Pier with batching at c=32 ≥ 0.95× direct ORT at batch 32", BATCHED, 32, DIRECT, 0.95)]
    group.notes += [
        "Pier rows: perf_analyzer over HTTP (its default protocol; binary tensor data), sync, one 32-token "
        f"sentence per request (batch 1), real token ids from `bench/tokenization.py` (`--input-data`, {len(ids)} "
        "rows); seq/s = infer/s; latency per request. The `over gRPC` rows measure the two target points with "
        "`-i grpc`: in a Python server a gRPC request costs more CPU than an HTTP one (grpc.aio's machinery; "
        "see identity_fp32.md), CPU that the two onnxruntime threads then lack on these 2 cores.",
        "onnxruntime direct rows: `InferenceSession.run` back to back in the harness process, default session "
        "options (as Pier's backend uses them), one call = one batch of that many sentences; latency per call.",
        f"{BATCHED}: `{MODEL}` as in model_repository/{MODEL}/config.pbtxt; {UNBATCHED}: the same model with its "
        "`dynamic_batching` section removed, served by the same Pier process.",
        f"Reading the c=1 rows: a dynamic batcher that honours `max_queue_delay_microseconds` ({_queue_delay()} µs "
        "here) can hold a lone request up to that long waiting for companions, so at c=1 the batched model is "
        "expected to trail the unbatched one by about that much latency.",
        "Reading the c=32 rows: 32 closed-loop clients against batches of up to 64. Once a batch splits (the "
        "first one leaves when the queue delay of its oldest request ends, with the requests parsed by then), "
        "the split repeats: the requests that queued while one batch ran have waited past the delay when it "
        "ends, so they leave at once, alone, while the others' answers go out and their next requests come "
        "in (Triton's dynamic batcher does the same). The notes list the batches each round formed; "
        "onnxruntime's time per sentence is higher in small batches (the direct rows at batch 8 and 32).",
        "Direct onnxruntime is the ceiling only in expectation: on this shared, noisy machine a few seconds' "
        "window can put a server row above it (compare the `rounds` column).",
    ]
    intro = [
        "all-MiniLM-L6-v2 exported to ONNX by `scripts/export_text_embedding.py` (pooling + L2 norm in the "
        "graph). The limit is onnxruntime itself called in-process at the batch size the server could form.",
    ]
    return report.write("text_embedding", "text_embedding: Pier (batching / no batching) vs direct onnxruntime",
                        settings, [group], targets, intro, notes, started)
