"""Each architecture's engine throughput vs Llama of the same size (issue 35, part 2).

Random-weight models in float32 with Llama's shape in bench/llm_bench.py (hidden 512, 8 layers, 8
heads, 4 KV heads of 64, MLP 1376, vocabulary 4096): Llama, Qwen3 (q/k norms), Gemma 2 (four norms a
layer, GeGLU, soft-capping, sliding window 128 on every other layer), Gemma 3 (q/k norms, a local
RoPE, window 128 on 5 layers of 6), Phi-3 (half of each head rotating, window 128), and the
mixtures of experts at Llama's active size: Mixtral and Qwen3-MoE with 8 experts of width 688,
2 per token (twice the stored MLP weights, the same multiply-adds per token). Windows of 128 so that
they act on this workload (prompts of 16-256 tokens, 16-128 generated). The engine runs in this
process (no server); the models take turns, round by round (`--rounds`), and each figure is the
median over rounds with its spread; the ratio is to Llama in the same round.

    flock /tmp/pier-cpu.lock .venv/bin/python -m bench.llm_archs [--requests 16] [--rounds 3] [--threads 1]

Writes bench/results/llm_archs.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.llm_bench import CACHE, RESULTS, VOCAB, build_model, log

COMMON = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
              tie_word_embeddings=False)
EXPERTS = dict(num_experts_per_tok=2)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3", {}),
    "gemma2": ("Gemma2", {"query_pre_attn_scalar": 64, "sliding_window": 128, "tie_word_embeddings": True}),
    "gemma3": ("Gemma3Text", {"query_pre_attn_scalar": 64, "sliding_window": 128, "tie_word_embeddings": True}),
    "phi3": ("Phi3", {"partial_rotary_factor": 0.5, "sliding_window": 128, "pad_token_id": 0}),
    "mixtral": ("Mixtral", {**EXPERTS, "num_local_experts": 8, "intermediate_size": 688}),
    "qwen3_moe": ("Qwen3Moe", {**EXPERTS, "num_experts": 8, "moe_intermediate_size": 688}),
}


def build(name: str, llama: Path) -> Path:
    """`name`'s model beside the Llama one, with its tokenizer."""
    if name == "llama":
        return llama
    folder = CACHE / f"arch-{name}"
    if (folder / "config.json").is_file():
        return folder
    import transformers

    prefix, extra = ARCHS[name]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra}))
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama / f, folder / f)
    return folder


LOCK_NOTE = "the run held the CPU lock"


def run(folder: Path, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.sampling_params import SamplingParams

    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=256 << 20))
    eng.generate([reqs[0][0][:16]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = eng.generate([p for p, _ in reqs], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                               for _, n in reqs])
    wall = time.perf_counter() - t0
    gen = sum(len(o[0]) for o in outs)
    return {"tok_s": gen / wall, "wall_s": wall, "generated_tokens": gen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier on a machine other work shares, as llm_bench's --threads 1)")
    ap.add_argument("--lock-note", default=LOCK_NOTE, help="how the run shared the machine, for the report")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    reqs = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 256))], rng.randint(16, 128))
            for _ in range(args.requests)]
    llama = build_model(CACHE / "model")
    names = ["llama", *ARCHS]
    folders = {name: build(name, llama) for name in names}
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # a different model first each round
        rounds.append({name: run(folders[name], reqs) for name in order})
        log(f"round {r + 1}: " + ", ".join(f"{n} {rounds[-1][n]['tok_s']:.0f}" for n in names))
    rows = []
    for name in names:
        tok = [rd[name]["tok_s"] for rd in rounds]
        ratio = [rd[name]["tok_s"] / rd["llama"]["tok_s"] for rd in rounds]
        rows.append({"model": name, "tok_s_median": statistics.median(tok), "tok_s_min": min(tok),
                     "tok_s_max": max(tok), "vs_llama_median": statistics.median(ratio),
                     "vs_llama_min": min(ratio), "vs_llama_max": max(ratio)})
    meta = {"requests": args.requests, "rounds": args.rounds, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                        time.gmtime())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "llm_archs.json").write_text(json.dumps({"meta": meta, "rows": rows, "rounds": rounds}, indent=1))
    lines = ["# Each architecture's engine throughput vs Llama of the same size", "",
             f"`python -m bench.llm_archs --requests {args.requests} --rounds {args.rounds} --threads {args.threads}` "
             f"({meta['when']}): "
             f"{args.requests} requests (prompts 16-256 tokens, 16-128 generated, greedy, all at once), "
             f"float32, the engine in-process with {meta['threads']} torch threads on this machine's 2 cores, "
             f"which are shared with other work ({args.lock_note}). Median over rounds "
             "[min-max]; the ratio is to Llama in the same round. Models: bench/llm_archs.py's docstring.", "",
             "| model | tokens/s | vs Llama |", "|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['tok_s_median']:.0f} [{row['tok_s_min']:.0f}-{row['tok_s_max']:.0f}] | "
                     f"{row['vs_llama_median']:.2f}x [{row['vs_llama_min']:.2f}-{row['vs_llama_max']:.2f}] |")
    (RESULTS / "llm_archs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
