"""In-process A/B of the LLM engine's step: an older revision's `backends/llm` (copied out of git as a
package of its own, `oldllm`) against this tree's, in one process, on the same model and requests,
rounds interleaved (old/new, new/old, ...). It sees what the engine costs (scheduler, KV accounting,
runner, model, sampler) without the server, the HTTP path or the two-server bias bench.ab has.

Model: bench/llm_bench.py's random ~27 M-parameter Llama (float32, one torch thread). Workload:
`--seqs` random prompts of 16-128 token ids, `--tokens` greedy tokens each (ignore_eos), all at once.

    .venv/bin/python -m bench.llm_step_ab --old main --out NAME     # bench/results/NAME.{json,md}
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import loadavg, machine
from bench.llm_bench import RESULTS, ROOT, build_model, log


def engine(pkg: str, folder: Path, seqs: int) -> tuple[Any, Any]:
    config, eng = importlib.import_module(pkg + ".config"), importlib.import_module(pkg + ".engine")
    params = importlib.import_module(pkg + ".sampling_params").SamplingParams
    return eng.LLMEngine(folder, config.EngineConfig(kv_cache_memory_bytes=1 << 30, block_size=16,
                                                     max_num_seqs=seqs)), params


def run(eng: Any, params: Any, prompts: list[list[int]], tokens: int, tag: str) -> float:
    p = params(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"{tag}{i}", prompt, p)
    start, n = time.perf_counter(), 0
    while eng.has_unfinished():
        n += sum(len(o.token_ids) for o in eng.step())
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="main")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default="llm_step_ab")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rev = subprocess.run(["git", "rev-parse", "--short", args.old], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "oldllm"
        pkg.mkdir()
        archive = subprocess.run(["git", "archive", rev, "backends/llm"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(pkg), "--strip-components=2"], input=archive.stdout, check=True)
        sys.path.insert(0, tmp)
        folder = build_model(Path(tmp) / "llama")
        engines = {"old": engine("oldllm", folder, args.seqs), "new": engine("pier.backends.llm", folder, args.seqs)}
        rng = random.Random(0)
        prompts = [[rng.randrange(2, 300) for _ in range(rng.randrange(16, 128))] for _ in range(args.seqs)]
        for side, (eng, params) in engines.items():
            run(eng, params, prompts[:4], 8, "warm" + side)
        rounds = []
        for r in range(args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            res = {side: run(*engines[side], prompts, args.tokens, f"r{r}{side}") for side in order}
            rounds.append({"order": "/".join(order), **{k: round(v, 1) for k, v in res.items()},
                           "ratio": round(res["new"] / res["old"], 3)})
            log(f"round {r}: {rounds[-1]}")
    ratios = [r["ratio"] for r in rounds]
    result = {"machine": machine(), "load_at_start": loadavg(), "old": rev, "seqs": args.seqs, "tokens": args.tokens,
              "rounds": rounds, "ratio_median": round(statistics.median(ratios), 3), "ratio_min": min(ratios),
              "ratio_max": max(ratios)}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# In-process engine step A/B: {rev} (old) vs this tree (new)", "",
             f"bench/llm_step_ab.py: the ~27 M random Llama, {args.seqs} sequences x {args.tokens} greedy tokens at "
             f"once, one torch thread, CPU lock held; the 2 cores are shared by the engine and other helpers' idle "
             f"processes. Output tok/s per round, interleaved.", "",
             "| round | order | old tok/s | new tok/s | new/old |", "|---|---|---|---|---|"]
    lines += [f"| {i} | {r['order']} | {r['old']} | {r['new']} | {r['ratio']} |" for i, r in enumerate(rounds)]
    lines += ["", f"new/old median {result['ratio_median']} (min {min(ratios)}, max {max(ratios)})."]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    log(lines[-1])


if __name__ == "__main__":
    main()
