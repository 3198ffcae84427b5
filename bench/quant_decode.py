"""Quantized weights in the engine (issue 34, part 2): decode tokens/s of int8 (online) and GPTQ 4-bit
weights vs the float model, on a random-weight Llama of about 200 M parameters (float32: 0.8 GB of
weights, so a decode step is bound by reading them), side by side in one process, interleaved rounds.

Batch 1 and batch 16, 16-token prompts, 48 greedy tokens each (ignore_eos), the engine in this
process (no server). The GPTQ checkpoint is packed from the float one by the tests' packer
(tests/backends/llm/quant_checkpoints.py, group size 128, symmetric: vLLM's CPU GPTQ takes no other).
vLLM on the same GPTQ folder, where its CPU build is installed (~/vllm-ref; --no-vllm to leave it
out): its CPU GPTQ runs only with 16-bit activations, so bfloat16 (Pier's columns are float32), one
vLLM process after Pier's rounds (not interleaved: its engine takes a minute to start), the same
prompts and token counts, each timed generate() after a 1-token request of the same prompts.

    .venv/bin/python -m bench.quant_decode    # ~8 minutes; writes bench/results/quant_decode.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / "bench" / ".cache" / "quant"
SIZE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=4, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
            tie_word_embeddings=False)


def build() -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT))
    from tests.backends.llm.quant_checkpoints import quantized_pair
    from tests.backends.llm.tiny_model import build_model

    float_dir = CACHE / "float"
    if not (float_dir / "model.safetensors").is_file():
        build_model(float_dir, "llama", **SIZE)
    gptq_dir = CACHE / "sym" / "gptq-4bit"
    if not (gptq_dir / "model.safetensors").is_file():
        quantized_pair(float_dir, CACHE / "sym", "gptq", 4, 128, sym=True)
    return float_dir, gptq_dir


def bench_prompts(batch: int) -> list[list[int]]:
    return [[2 + (i * 7 + j) % 4000 for j in range(16)] for i in range(batch)]


def vllm_rates(gptq_dir: Path, rounds: int, tokens: int) -> dict[str, list[float]] | str:
    """vLLM's decode tokens/s on the GPTQ folder (bfloat16) per batch size, or why there are none."""
    from tests.backends.llm.vllm_reference import VLLM_PYTHON, run_vllm

    if not VLLM_PYTHON.is_file():
        return f"not run: vLLM's CPU build is not installed ({VLLM_PYTHON})"
    try:
        got = run_vllm(gptq_dir, bench_prompts(1), 1, "bfloat16", timed=[1, 16] * rounds,
                       timed_prompts=bench_prompts(16), max_tokens_timed=tokens, max_model_len=16 + tokens + 1,
                       enforce_eager=False)  # its default: the model compiled (torch.compile), as it is served
    except RuntimeError as exc:
        return f"does not run: {exc}"
    rates: dict[str, list[float]] = {}
    for batch, rate in got["timed"]:
        rates.setdefault(str(batch), []).append(rate)
    return rates


def decode_rate(eng: LLMEngine, batch: int, tokens: int) -> float:
    prompts = bench_prompts(batch)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))  # prefill cost apart
    start = time.perf_counter()
    eng.generate(prompts, params)
    return batch * tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM's CPU build out")
    args = parser.parse_args()
    float_dir, gptq_dir = build()
    engines = {"float32": LLMEngine(float_dir, EngineConfig(kv_cache_memory_bytes=256 << 20)),
               "int8 (online)": LLMEngine(float_dir, EngineConfig(kv_cache_memory_bytes=256 << 20,
                                                                   quantization="int8")),
               "gptq 4-bit": LLMEngine(gptq_dir, EngineConfig(kv_cache_memory_bytes=256 << 20))}
    rates: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for batch in (1, 16):
            for name, eng in engines.items():
                rates.setdefault(str(batch), {}).setdefault(name, []).append(decode_rate(eng, batch, args.tokens))
    weights = {name: sum(lin.weight.nbytes for layer in eng.model.layers  # type: ignore[attr-defined]
                         for lin in layer.linears if lin.weight is not None) / 2**20
               for name, eng in engines.items()}  # PackedWeight.nbytes: q, scales and zeros
    names = list(engines)
    engines.clear()  # their memory back before vLLM starts
    vllm = "not run (--no-vllm)" if args.no_vllm else vllm_rates(gptq_dir, args.rounds, args.tokens)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quant_decode.json").write_text(json.dumps({"size": SIZE, "rounds": args.rounds, "tokens": args.tokens,
                                                           "tokens_per_s": rates, "projection_mib": weights,
                                                           "vllm_gptq_bfloat16": vllm}, indent=1))
    lines = ["# Quantized weights: engine decode tokens/s vs float32", "",
             f"Random-weight Llama, hidden 1024, 16 layers, intermediate 2816 (~200 M parameters), float32 "
             f"activations, {args.tokens} greedy tokens after a 16-token prompt, {args.rounds} interleaved rounds "
             f"(median; range in brackets), {torch.get_num_threads()} threads; the 2 cores are shared with other "
             "work on this machine. The decoder projections' stored size: "
             + ", ".join(f"{n} {mib:.0f} MiB" for n, mib in weights.items()) + ".", "",
             "| batch | " + " | ".join(names) + " | int8 / float | 4-bit / float | vLLM gptq 4-bit (bfloat16) | "
             "Pier 4-bit / vLLM 4-bit |",
             "|---:|" + "---:|" * (len(names) + 4)]
    for batch, by in rates.items():
        med = {n: statistics.median(v) for n, v in by.items()}
        cells = [f"{med[n]:.1f} [{min(by[n]):.1f}-{max(by[n]):.1f}]" for n in names]
        theirs = vllm.get(batch) if isinstance(vllm, dict) else None
        v = (f"{statistics.median(theirs):.1f} [{min(theirs):.1f}-{max(theirs):.1f}] | "
             f"{med['gptq 4-bit'] / statistics.median(theirs):.2f}x" if theirs else "- | -")
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {med['int8 (online)'] / med['float32']:.2f}x | "
                     f"{med['gptq 4-bit'] / med['float32']:.2f}x | {v} |")
    if isinstance(vllm, str):
        lines += ["", f"vLLM (CPU build 0.32) on the GPTQ folder: {vllm}"]
    else:
        lines += ["", "vLLM: its CPU build 0.32 (~/vllm-ref) on the same GPTQ folder, bfloat16 activations (its CPU "
                  "GPTQ refuses float32), CPUWNA16 kernel, compiled (its default, not enforce_eager), block size 32, "
                  "VLLM_CPU_OMP_THREADS_BIND "
                  "all cores; one process after Pier's rounds, its rounds back to back (median; range)."]
    (RESULTS / "quant_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
