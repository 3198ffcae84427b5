"""Tensor parallelism on this machine: 1 rank vs 2 ranks (backends/llm/parallel/), and the
shared-memory all-reduce vs gloo's, the choice it made.

1. The all-reduce alone: two processes join a gloo group on loopback and each all-reduces float32
   tensors of a decode step's size (1 and 16 rows of the hidden size) and of a prefill's (256 rows)
   through gloo and through `ShmAllReduce`, interleaved rounds; the median microseconds per call.
2. The engine: a random-weight Llama (hidden 768, 12 heads, 4 KV heads, 8 layers, MLP 2048, vocab
   16384; ~75 M parameters, float32) in LLMEngine with tensor_parallel_size 1 (2 torch threads) and 2
   (1 thread per rank), both loaded side by side, interleaved rounds: 16 prompts of 64 tokens, 32
   greedy tokens each; generated tokens/s, and the outputs compared.

The machine has 2 cores, shared by both ranks (and by the 1-rank engine's two threads): a second rank
brings no second machine's memory bandwidth here, so this measures the overhead of the split (the
collectives, the step shipped to the worker), not the gain a second device brings.

    .venv/bin/python -m bench.tensor_parallel          # writes bench/results/tensor_parallel.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
HIDDEN = 768
ROWS = (1, 16, 256)


def _allreduce_rank(rank: int, port: int, name: str, calls: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from pier.backends.llm.parallel.shm_allreduce import ShmAllReduce

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 0:
        shm = ShmAllReduce(name, rank, 2, lambda: False, create=True)
    dist.barrier()
    if rank == 1:
        shm = ShmAllReduce(name, rank, 2, lambda: False)
    dist.barrier()
    if rank == 0:
        shm.unlink()
    result: dict[str, dict[str, list[float]]] = {}
    for rows in ROWS:
        t = torch.randn(rows, HIDDEN)
        per = result.setdefault(str(rows), {"gloo": [], "shm": []})
        for _ in range(rounds):
            for kind in ("gloo", "shm"):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    if kind == "gloo":
                        dist.all_reduce(t)
                    else:
                        shm.all_reduce(t)
                    t.mul_(0.5)
                per[kind].append((time.perf_counter() - start) / calls * 1e6)
    dist.barrier()
    shm.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def allreduce(calls: int, rounds: int) -> dict[str, dict[str, float]]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    name = f"pier-tp-bench-{os.getpid()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, name, calls, rounds, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    raw = json.loads(Path(out).read_text())
    os.unlink(out)
    return {rows: {kind: statistics.median(v) for kind, v in per.items()} for rows, per in raw.items()}


def engines(rounds: int, tokens: int, device: str) -> dict[str, object]:
    import random

    import torch

    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.sampling_params import SamplingParams
    from tests.backends.llm.tiny_model import build_model

    folder = Path(tempfile.mkdtemp(prefix="pier-tp-bench-")) / "model"
    build_model(folder, "llama", hidden_size=HIDDEN, num_attention_heads=12, num_key_value_heads=4,
                num_hidden_layers=8, intermediate_size=2048, vocab_size=16384, max_position_embeddings=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 300) for _ in range(64)] for _ in range(16)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    torch.set_num_threads(2)
    one = LLMEngine(folder, EngineConfig(device=device, kv_cache_memory_bytes=256 << 20, num_threads=2))
    two = LLMEngine(folder, EngineConfig(device=device, kv_cache_memory_bytes=256 << 20, tensor_parallel_size=2,
                                         num_threads=1))
    torch.set_num_threads(2)  # the 1-rank engine's threads (the 2-rank engine's rank 0 set 1)
    rates: dict[str, list[float]] = {"1 rank": [], "2 ranks": []}
    outs: dict[str, list[list[list[int]]]] = {}
    try:
        for eng in (one, two):  # warm: the first steps of each shape
            eng.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        for _ in range(rounds):
            for label, eng, threads in (("1 rank", one, 2), ("2 ranks", two, 1)):
                torch.set_num_threads(threads)
                start = time.perf_counter()
                outs[label] = eng.generate(prompts, params)
                rates[label].append(len(prompts) * tokens / (time.perf_counter() - start))
    finally:
        two.close()
    ratios = [b / a for a, b in zip(rates["1 rank"], rates["2 ranks"])]
    return {"rates": rates, "ratio_2_over_1": ratios, "same_outputs": outs["1 rank"] == outs["2 ranks"],
            "prompts": len(prompts), "prompt_tokens": 64, "tokens": tokens}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "tensor_parallel"))
    ap.add_argument("--device", default="cpu", help="cuda: the engines on GPUs (NCCL; the all-reduce table is CPU's)")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    ar = allreduce(args.calls, args.rounds) if args.device == "cpu" else {}
    eng = engines(args.rounds, args.tokens, args.device)
    result = {"allreduce_us": ar, "engine": eng, "load_at_start": load, "cores": os.cpu_count(), "device": args.device}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Tensor parallelism: 1 rank vs 2 ranks, shared-memory all-reduce vs gloo",
        "",
        f"`.venv/bin/python -m bench.tensor_parallel` ({args.rounds} interleaved rounds). This machine has "
        f"{os.cpu_count()} cores, **shared by both ranks** (and by other work: load {load:.1f} at the start); a "
        "second rank brings no second device here, so the figures are the split's overhead, not its gain.",
        "",
        "## The all-reduce alone (2 processes, float32, median microseconds per call)",
        "",
        "| rows x 768 | bytes | gloo (loopback TCP) | shared memory | gloo / shm |",
        "|---|---|---|---|---|",
    ]
    for rows, per in ar.items():
        lines.append(f"| {rows} | {int(rows) * HIDDEN * 4:,} | {per['gloo']:.1f} | {per['shm']:.1f} | "
                     f"{per['gloo'] / per['shm']:.2f}x |")
    r1, r2 = eng["rates"]["1 rank"], eng["rates"]["2 ranks"]  # type: ignore[index]
    ratios = eng["ratio_2_over_1"]  # type: ignore[index]
    lines += [
        "",
        f"## The engine: {eng['prompts']} prompts of {eng['prompt_tokens']} tokens, {eng['tokens']} greedy tokens "
        "each (random-weight Llama, ~75 M parameters, float32)",
        "",
        "| | generated tokens/s per round | median |",
        "|---|---|---|",
        f"| 1 rank (2 threads) | {', '.join(f'{x:.0f}' for x in r1)} | {statistics.median(r1):.0f} |",
        f"| 2 ranks (1 thread each) | {', '.join(f'{x:.0f}' for x in r2)} | {statistics.median(r2):.0f} |",
        "",
        f"2 ranks / 1 rank: {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); "
        f"outputs the same: {eng['same_outputs']}.",
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
