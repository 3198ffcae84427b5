"""2 ranks on this machine, an older revision against this checkout (a change to the tensor-parallel
executor must keep the local ranks' speed): bench.tensor_parallel's engine workload (random-weight
Llama, ~75 M parameters, float32; 16 prompts of 64 tokens, 32 greedy tokens each) in LLMEngine with
tensor_parallel_size 2 (1 thread per rank), each revision in processes of its own (a git worktree,
bench/revisions.py), interleaved rounds (A B B A ...); generated tokens/s, ratios new/old with their
spread, and the outputs compared. The machine's 2 cores are shared by both ranks (and by whatever
else runs: hold the CPU lock).

    cpulock .venv/bin/python -m bench.tensor_parallel_ab --old <rev>   # bench/results/tensor_parallel_ab.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT
from bench.revisions import _old_env, check_old_imports, git, worktree

RESULTS = ROOT / "bench" / "results"

ROUND = """
import json, random, sys, time
from pathlib import Path
import torch
from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams
folder, tokens = Path(sys.argv[1]), int(sys.argv[2])
rng = random.Random(0)
prompts = [[rng.randrange(2, 300) for _ in range(64)] for _ in range(16)]
eng = LLMEngine(folder, EngineConfig(device="cpu", kv_cache_memory_bytes=256 << 20, tensor_parallel_size=2,
                                     num_threads=1))
try:
    eng.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    rate = len(prompts) * tokens / (time.perf_counter() - start)
finally:
    eng.close()
print(json.dumps({"rate": rate, "outs": [o for o in outs]}, default=lambda o: getattr(o, "token_ids", str(o))))
"""


def _round(env: dict[str, str], cwd: Path, folder: Path, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", ROUND, str(folder), str(tokens)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the revision to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "tensor_parallel_ab"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.tensor_parallel import HIDDEN
    from tests.backends.llm.tiny_model import build_model

    folder = Path(tempfile.mkdtemp(prefix="pier-tp-ab-")) / "model"
    build_model(folder, "llama", hidden_size=HIDDEN, num_attention_heads=12, num_key_value_heads=4,
                num_hidden_layers=8, intermediate_size=2048, vocab_size=16384, max_position_embeddings=1024)
    old_rev = git("rev-parse", "--short", args.old)
    dirty = git("status", "--porcelain", "--untracked-files=no")
    new_rev = git("rev-parse", "--short", "HEAD") + ("+" if dirty else "")
    rates: dict[str, list[float]] = {"old": [], "new": []}
    outs: dict[str, object] = {}
    with worktree(args.old) as tree:
        check_old_imports(tree)
        old_env = {k: v for k, v in _old_env(tree).items() if k != "TORCH_EXTENSIONS_DIR"}  # same kernels' digest
        new_env = dict(os.environ)
        for i in range(args.rounds):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for label in order:
                env, cwd = (old_env, tree) if label == "old" else (new_env, ROOT)
                r = _round(env, cwd, folder, args.tokens)
                rates[label].append(r["rate"])
                outs[label] = r["outs"]
                print(f"round {i + 1} {label}: {r['rate']:.1f} tok/s", flush=True)
    ratios = [n / o for o, n in zip(rates["old"], rates["new"])]
    result = {"old": old_rev, "new": new_rev, "rates": rates, "ratio_new_over_old": ratios,
              "same_outputs": outs["old"] == outs["new"], "load": os.getloadavg()[0]}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    med = {k: statistics.median(v) for k, v in rates.items()}
    Path(args.out + ".md").write_text(
        f"# 2 local tensor-parallel ranks: {old_rev} (old) vs {new_rev} (new)\n\n"
        "`cpulock .venv/bin/python -m bench.tensor_parallel_ab --old <rev>`: the engine workload of "
        "bench.tensor_parallel (random-weight Llama, ~75 M parameters, float32, 16 prompts x 64 tokens, "
        f"{args.tokens} greedy tokens each), tensor_parallel_size 2, 1 thread per rank, each revision in its "
        f"own processes, {args.rounds} interleaved rounds (ABBA...). The machine's 2 cores are shared by both "
        f"ranks (load {result['load']:.1f} at the end).\n\n"
        "| | generated tokens/s per round | median |\n|---|---|---|\n"
        + "".join(f"| {k} | {', '.join(f'{x:.0f}' for x in v)} | {med[k]:.0f} |\n" for k, v in rates.items())
        + f"\nnew / old: {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); "
        f"outputs the same: {result['same_outputs']}.\n")
    print(Path(args.out + ".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
