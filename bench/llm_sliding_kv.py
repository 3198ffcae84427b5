"""Sliding-window layers that give back out-of-window blocks (kv_groups.py) vs keeping every block
(issue 35): how many long sequences fit one KV budget, and the throughput at that concurrency. One
run, Pier's engine in this process, interleaved rounds.

Model: a random-weight Gemma-2-like model built here with transformers (8 layers alternating sliding
window and global attention, 4 heads, 2 KV heads of 64, hidden 256; `--window` tokens, default 128),
float32. Workload: random prompts of `--prompt` tokens, `--tokens` generated (greedy, ignore_eos),
block size 16. Budget: `kv_cache_memory_bytes` sized so that keeping every block ("kept": every layer
in one KV cache group, as before this change) holds `--kept-seqs` such sequences.

Per side: the concurrency that fits (num_blocks // blocks one sequence holds at its end: kept, every
group every block; freed, a full-attention group every block and a sliding one (W - 1) // 16 + 2),
then that many requests at once with max_num_seqs = that many: output tok/s and preemptions (none
expected); then both sides with the freed side's concurrency of requests, so the kept side queues and
preempts. The outputs of both sides are compared token for token.

    .venv/bin/python -m bench.llm_sliding_kv          # bench/results/llm_sliding_kv.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import loadavg, machine
from bench.llm_bench import RESULTS, log
from pier.backends.llm import model_runner
from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.kv_groups import KVCacheGroup, group_layers
from pier.backends.llm.sampling_params import SamplingParams

BS = 16


def build(folder: Path, window: int) -> Path:
    import transformers

    from tests.backends.llm.tiny_model import build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    cfg = transformers.Gemma2Config(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    query_pre_attn_scalar=64, sliding_window=window, max_position_embeddings=4096,
                                    bos_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def one_group(specs: list) -> list[KVCacheGroup]:
    """Every layer in one full-attention group: every block kept (the masks still slide)."""
    return [KVCacheGroup(0, tuple(range(len(specs))))]


def engine(folder: Path, budget: int, seqs: int, kept: bool) -> LLMEngine:
    real = model_runner.group_layers
    if kept:
        model_runner.group_layers = one_group  # type: ignore[assignment]
    try:
        return LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=budget, block_size=BS, max_num_seqs=seqs,
                                              max_num_batched_tokens=2048))
    finally:
        model_runner.group_layers = real  # type: ignore[assignment]


def seats(eng: LLMEngine, n: int) -> None:
    """max_num_seqs = n from now on."""
    eng.scheduler.config = dataclasses.replace(eng.scheduler.config, max_num_seqs=n)


def run(eng: LLMEngine, reqs: list[list[int]], tokens: int) -> dict[str, Any]:
    pre = eng.stats().num_preemptions
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    base = f"r{time.monotonic_ns()}-"
    for i, p in enumerate(reqs):
        eng.add_request(f"{base}{i}", p, params)
    answers: dict[str, list[int]] = {f"{base}{i}": [] for i in range(len(reqs))}
    peak = 0
    start = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            answers[o.request_id].extend(o.token_ids)
        peak = max(peak, len(eng.scheduler.running))
    wall = time.perf_counter() - start
    return {"requests": len(reqs), "wall_s": round(wall, 2), "tok_s": round(len(reqs) * tokens / wall, 1),
            "preemptions": eng.stats().num_preemptions - pre, "peak_running": peak,
            "answers": [answers[f"{base}{i}"] for i in range(len(reqs))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kept-seqs", type=int, default=6, help="sequences the budget holds with every block kept")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="llm_sliding_kv")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "gemma2", args.window)
        length = args.prompt + args.tokens
        blocks = -(-length // BS)
        model_runner.group_layers = one_group  # type: ignore[assignment]
        try:  # a block of every layer
            kept_block = model_runner.kv_bytes_per_block(engine(folder, 1 << 24, 1, True).model, BS)
        finally:
            model_runner.group_layers = group_layers
        budget = args.kept_seqs * blocks * kept_block
        engines = {"kept": engine(folder, budget, 256, True), "freed": engine(folder, budget, 256, False)}
        held = {"kept": blocks, "freed": blocks + (args.window - 1) // BS + 2}
        fit = {k: e.kv.pool.num_blocks // held[k] for k, e in engines.items()}
        for k, e in engines.items():
            seats(e, fit[k])
            log(f"{k}: {len(e.kv.windows)} KV cache group(s), {e.kv.pool.num_blocks} blocks, "
                f"{held[k]} per sequence of {length} tokens: {fit[k]} fit")
        rng = random.Random(1)
        many = fit["freed"]
        reqs = [[rng.randrange(2, 320) for _ in range(args.prompt)] for _ in range(many)]
        for e in engines.values():
            run(e, reqs[:1], 4)  # warm-up: kernels
        rounds: list[dict[str, Any]] = []
        same = None
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            order = ("kept", "freed") if r % 2 == 0 else ("freed", "kept")
            for k in order:
                res = run(engines[k], reqs[: fit[k]], args.tokens)
                row[f"{k}@fit"] = {x: v for x, v in res.items() if x != "answers"}
                log(f"round {r}: {k} at its fit ({fit[k]}): {row[f'{k}@fit']}")
            outs = {}
            for k in order:
                seats(engines[k], many)
                res = run(engines[k], reqs, args.tokens)
                seats(engines[k], fit[k])
                outs[k] = res.pop("answers")
                row[f"{k}@{many}"] = res
                log(f"round {r}: {k} with {many} requests: {res}")
            same = outs["kept"] == outs["freed"]
            rounds.append(row)
    ratio = [row["freed@fit"]["tok_s"] / row["kept@fit"]["tok_s"] for row in rounds]
    result = {"machine": machine(), "load_at_start": loadavg(), "window": args.window, "prompt": args.prompt,
              "tokens": args.tokens, "block_size": BS, "budget_bytes": budget, "blocks": {
                  k: e.kv.pool.num_blocks for k, e in engines.items()}, "held_per_seq": held, "fit": fit,
              "rounds": rounds, "tok_s_ratio_at_fit": [round(x, 3) for x in ratio],
              "tok_s_ratio_median": round(statistics.median(ratio), 3), "same_tokens": same,
              "torch_threads": torch.get_num_threads()}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    log(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
