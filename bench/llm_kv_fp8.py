"""FP8 KV cache vs the float32 cache (issue 34, part 3): how many sequences fit one KV budget, and the
throughput at that concurrency. One run, Pier's engine in this process, interleaved rounds.

Model: SmolLM2-135M-Instruct as `make smollm2` builds it (float32; 30 layers x 3 KV heads x 64 =
46,080 bytes of float32 K/V per token, 11,520 in FP8), or `--model`. Workload: chat requests (the
model's template, topics as bench/llm_real_model.py), greedy, `--tokens` tokens each with ignore_eos.
Budget: `kv_cache_memory_bytes` sized so that the float32 cache holds `--auto-seqs` such sequences.

Per cache dtype (auto, fp8, fp8_e5m2): the concurrency that fits (num_blocks // blocks per sequence),
then that many requests at once with max_num_seqs = that many: output tok/s, preemptions (none
expected). Then both with the FP8 concurrency's requests, so auto must queue: tok/s, wall time.
Accuracy on the real model: FP8's answers against auto's at the same requests (same text, the mean
first divergence step, mean |delta logprob| of the chosen tokens before it).

    .venv/bin/python -m bench.llm_kv_fp8 --model /path/to/SmolLM2-135M-Instruct   # bench/results/llm_kv_fp8.*
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import loadavg, machine
from bench.llm_bench import RESULTS, log
from bench.llm_real_model import ASKS, SMOLLM2, TOPICS
from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.model_runner import kv_bytes_per_block
from pier.backends.llm.sampling_params import SamplingParams

DTYPES = ("auto", "fp8", "fp8_e5m2")


def prompts(eng: LLMEngine, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        chat = [{"role": "user", "content": ASKS[(i // len(TOPICS)) % len(ASKS)].format(TOPICS[i % len(TOPICS)])}]
        out.append(eng.tokenizer.encode(eng.tokenizer.apply_chat_template(chat), add_special_tokens=False))
    return out


def run(eng: LLMEngine, reqs: list[list[int]], tokens: int) -> dict[str, Any]:
    """All requests at once; output tok/s, wall time, preemptions, and each answer's (token, logprob)."""
    pre = eng.stats().num_preemptions
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=0)
    base = f"r{time.monotonic_ns()}-"
    for i, p in enumerate(reqs):
        eng.add_request(f"{base}{i}", p, params)
    answers: dict[str, list[tuple[int, float]]] = {f"{base}{i}": [] for i in range(len(reqs))}
    start = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            answers[o.request_id].extend((t, lp[0]) for t, lp in zip(o.token_ids, o.logprobs))
    wall = time.perf_counter() - start
    return {"requests": len(reqs), "wall_s": round(wall, 2), "tok_s": round(len(reqs) * tokens / wall, 1),
            "preemptions": eng.stats().num_preemptions - pre,
            "answers": [answers[f"{base}{i}"] for i in range(len(reqs))]}


def agreement(ref: list[list[tuple[int, float]]], got: list[list[tuple[int, float]]]) -> dict[str, Any]:
    same, firsts, diffs = 0, [], []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), len(a))
        same += n == len(a)
        firsts.append(n)
        diffs.extend(abs(x[1] - y[1]) for x, y in zip(a[:n], b[:n]))
    return {"same_answers": same, "of": len(ref), "mean_first_divergence": round(statistics.mean(firsts), 1),
            "mean_abs_dlogprob": round(statistics.mean(diffs), 4) if diffs else None,
            "max_abs_dlogprob": round(max(diffs), 4) if diffs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=SMOLLM2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--auto-seqs", type=int, default=8, help="sequences the float32 cache's budget holds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="llm_kv_fp8")
    args = ap.parse_args()
    if not (args.model / "model.safetensors").is_file():
        raise SystemExit(f"no model at {args.model}: run `make smollm2` or pass --model")
    bs = 16
    probe = LLMEngine(args.model, EngineConfig(kv_cache_memory_bytes=1 << 26, block_size=bs))
    per_block = kv_bytes_per_block(probe.model, bs)
    reqs_all = prompts(probe, 256)
    longest = max(len(p) for p in reqs_all) + args.tokens
    blocks_per_seq = -(-longest // bs)
    budget = args.auto_seqs * blocks_per_seq * per_block
    del probe
    log(f"budget {budget} bytes: {args.auto_seqs} x {blocks_per_seq} blocks of {per_block} bytes (float32)")
    engines, fit = {}, {}
    for dt in DTYPES:
        engines[dt] = LLMEngine(args.model, EngineConfig(kv_cache_memory_bytes=budget, block_size=bs,
                                                         kv_cache_dtype=dt, max_num_seqs=256))
        fit[dt] = engines[dt].kv.pool.num_blocks // blocks_per_seq
        log(f"{dt}: {engines[dt].kv.pool.num_blocks} blocks, {fit[dt]} sequences of {longest} tokens fit")
    for dt in DTYPES:  # warm-up (kernels, first prefill derives the FP8 scales)
        run(engines[dt], reqs_all[:2], 4)
    rounds: list[dict[str, Any]] = []
    many = fit["fp8"]
    for r in range(args.rounds):
        row: dict[str, Any] = {}
        order = DTYPES[r % len(DTYPES):] + DTYPES[: r % len(DTYPES)]
        for dt in order:  # each at the concurrency its cache fits
            eng = engines[dt]
            res = run(eng, reqs_all[: fit[dt]], args.tokens)
            row[f"{dt}@fit"] = {k: v for k, v in res.items() if k != "answers"}
            log(f"round {r}: {dt} at its fit ({fit[dt]}): {row[f'{dt}@fit']}")
        for dt in ("auto", "fp8"):  # the FP8 concurrency's requests through both
            res = run(engines[dt], reqs_all[:many], args.tokens)
            row[f"{dt}@{many}"] = {k: v for k, v in res.items() if k != "answers"}
            row[f"{dt}@{many}_answers"] = res["answers"]
            log(f"round {r}: {dt} with {many} requests: {row[f'{dt}@{many}']}")
        rounds.append(row)
    acc = {dt: agreement(rounds[0][f"auto@{many}_answers"], run(engines[dt], reqs_all[:many], args.tokens)["answers"])
           for dt in ("fp8", "fp8_e5m2")}
    for row in rounds:
        for k in [k for k in row if k.endswith("_answers")]:
            del row[k]
    scales = {dt: [(round(s.k, 5), round(s.v, 5)) for s in engines[dt].runner.kv_scales or []]
              for dt in ("fp8", "fp8_e5m2")}
    clamped = {dt: engines[dt].runner.kv_clamped for dt in ("fp8", "fp8_e5m2")}
    result = {"machine": machine(), "load_at_start": loadavg(), "model": str(args.model), "tokens": args.tokens,
              "budget_bytes": budget, "blocks_per_seq": blocks_per_seq, "fit": fit, "rounds": rounds,
              "accuracy_vs_auto": acc, "clamped": clamped, "scales_first_layers": {k: v[:3] for k, v in scales.items()},
              "torch_threads": torch.get_num_threads()}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    log(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
